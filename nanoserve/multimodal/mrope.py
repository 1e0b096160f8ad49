"""Qwen2.5-VL's multimodal rotary positions (transformers' `get_rope_index` for images), in
plain Python.

A prompt's tokens get three positions each (temporal, height, width):
- a text token: p, p, p, where p is one more than the previous token's largest position;
- an image of (t, gh, gw) patches becomes t * (gh/m) * (gw/m) tokens (m: merge size), in
  raster order: the token at (f, y, x) gets (s + f, s + y, s + x), s being where the image
  starts; the text after it continues at s + max(gh, gw) / m.

    text text [img 2x3] text      ->  t: 0 1 2 2 2 2 2 2 5
                                      h: 0 1 2 2 2 3 3 3 5
                                      w: 0 1 2 3 4 2 3 4 5

So a row's positions run behind its token count: `delta` = (largest position + 1) - prompt
length (<= 0). Every token after the prompt (generated, or a preempted row's recomputed
ones) is text: the token at index j has position j + delta in all three. A decode step's
rotary position is therefore its cache position + delta, not its cache position: the
scheduler carries `delta` per row (`Sequence.rope_delta`).
"""

from __future__ import annotations

from collections.abc import Sequence


def mrope_positions(tokens: Sequence[int], grids: Sequence[tuple[int, int, int]],
                    image_token_id: int, merge_size: int) -> tuple[list[list[int]], int]:
    """([t positions, h positions, w positions] each len(tokens), delta). Runs of
    `image_token_id` take the images of `grids` in order, each its own token count
    (ValueError when the placeholders and the images disagree)."""
    t_pos: list[int] = []
    h_pos: list[int] = []
    w_pos: list[int] = []
    images = iter(grids)
    cur = 0
    i, n = 0, len(tokens)
    while i < n:
        if tokens[i] != image_token_id:
            t_pos.append(cur)
            h_pos.append(cur)
            w_pos.append(cur)
            cur += 1
            i += 1
            continue
        grid = next(images, None)
        if grid is None:
            raise ValueError("the prompt has more image placeholder tokens than images")
        t, gh, gw = grid
        bh, bw = gh // merge_size, gw // merge_size
        count = t * bh * bw
        if list(tokens[i:i + count]) != [image_token_id] * count:
            raise ValueError(f"an image of {count} tokens has fewer placeholder tokens")
        for f in range(t):
            for y in range(bh):
                for x in range(bw):
                    t_pos.append(cur + f)
                    h_pos.append(cur + y)
                    w_pos.append(cur + x)
        cur += max(bh, bw)
        i += count
    if next(images, None) is not None:
        raise ValueError("the prompt has fewer image placeholder tokens than images")
    return [t_pos, h_pos, w_pos], cur - n


def extend_positions(positions: list[list[int]], delta: int, length: int) -> list[list[int]]:
    """`positions` of a prompt continued (text tokens) up to `length` tokens."""
    start = len(positions[0])
    tail = list(range(start + delta, length + delta))
    return [p + tail for p in positions]
