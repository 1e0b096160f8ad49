"""nanoserve inside a Ray Data pipeline: read prompts, generate, write Parquet.

    python examples/ray_data.py                                  # CPU, one engine
    python examples/ray_data.py --num-gpus 1 --concurrency 4     # four engines, one GPU each
    python examples/ray_data.py --input 's3://bucket/prompts/' --output out/

Rows need a `prompt`, `messages` or `prompt_token_ids` column (per-row `max_tokens`,
`temperature`, `top_p`, `top_k`, `seed` columns override the defaults, as do `n`,
`logprobs`, `prompt_logprobs` and structured outputs: see docs/guide.md); each output row is
the input row plus `generated_text`, `generated_token_ids`, `num_input_tokens`,
`num_generated_tokens`, `finish_reason` and `error` (bad rows are error rows), once per
sample.
Ray Data streams the dataset through the engines, so it may be larger than memory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import ray.data

from nanoserve import DEFAULT_MODEL
from ray_jobs.data_processor import build_processor
from ray_jobs.dispatch.local_ray import RaySession

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", default=str(HERE / "prompts.jsonl"),
                   help="JSONL file or folder (default: examples/prompts.jsonl)")
    p.add_argument("--output", default="ray-data-output", help="Parquet output folder")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--concurrency", type=int, default=1, help="engines (actors)")
    p.add_argument("--num-gpus", type=float, default=0, help="GPUs per engine (0: CPU)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--address", default=None, help="Ray address (default: local)")
    args = p.parse_args()

    with RaySession(args.address):
        process = build_processor(args.model, concurrency=args.concurrency,
                                  num_gpus=args.num_gpus, max_tokens=args.max_tokens)
        ds = process(ray.data.read_json(args.input))
        ds.write_parquet(args.output)
        for row in ray.data.read_parquet(args.output).take(3):
            print(f"{row['id']}: {row['generated_text']!r} ({row['finish_reason']})")


if __name__ == "__main__":
    main()
