"""The README's commands and Python snippets run as written, in the order a reader meets them.

Every ```bash and ```python block of README.md runs on the CPU with the default model, in a
fresh folder that holds a link to `examples/` (so the outputs, `out/...`, land there and not
in the repository), with `nanoserve` on the PATH as this checkout's command. A block is left
out only when the line before its fence is `<!-- readme-test: skip (why) -->`: the set-up
commands (`make demo`, `make test`, which CI runs), a download, a cloud cluster."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SKIP_MARK = re.compile(r"^<!-- readme-test: skip \((.+)\) -->$")
FENCE = re.compile(r"^```(\w*)\s*$")
BLOCK_TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None  # why it is not run, or None


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks of the README, with their skip reasons."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        body = []
        while not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        before = lines[start - 1] if start else ""
        mark = SKIP_MARK.match(before)
        blocks.append(Block(start + 1, lang, "\n".join(body) + "\n",
                            mark.group(1) if mark else None))
        i += 1
    return blocks


def test_readme_is_short_and_starts_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 250
    first = readme_blocks(text)[0]
    commands = [line.split("#")[0].strip() for line in first.code.splitlines()]
    assert commands == ["make demo", "make test"]
    assert first.skip is not None


def test_every_skipped_block_says_why_and_most_run():
    blocks = [b for b in readme_blocks(README.read_text(encoding="utf-8"))
              if b.lang in ("bash", "python")]
    skipped = [b for b in blocks if b.skip is not None]
    assert all(b.skip.strip() for b in skipped)
    assert len(skipped) <= 3 < len(blocks) - len(skipped)


@pytest.mark.slow
def test_readme_commands_and_snippets_run(tmp_path):
    """Each runnable block in order; the first that fails names its README line and shows
    its output. Then a few results the README describes."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    command = bin_dir / "nanoserve"
    command.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m nanoserve_cli "$@"\n')
    command.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")])),
           "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    ran = 0
    for block in readme_blocks(README.read_text(encoding="utf-8")):
        if block.lang not in ("bash", "python") or block.skip is not None:
            continue
        argv = (["bash", "-euo", "pipefail", "-c", block.code] if block.lang == "bash"
                else [sys.executable, "-c", block.code])
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=BLOCK_TIMEOUT_S)
        assert proc.returncode == 0, (
            f"README.md line {block.line} ({block.lang}) failed with {proc.returncode}:\n"
            f"{block.code}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
        ran += 1
    assert ran >= 8
    out = tmp_path / "out"
    for job in ("chat", "people", "vectors", "openai", "api"):
        assert (out / job / "_SUCCESS").exists(), job
    errors = (out / "openai" / "errors.jsonl").read_text().splitlines()
    assert len(errors) == 1 and '"req-4"' in errors[0] and "logit_bias" in errors[0]
