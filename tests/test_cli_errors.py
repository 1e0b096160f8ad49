"""The command line's own errors: an unknown flag is its subcommand's error, with that
subcommand's usage and the closest known flag; an invalid choice names the closest one. And
the flags both job subcommands have, read alike."""

from __future__ import annotations

import pytest

from nanoserve_cli import main as nanoserve_main
from ray_jobs.cli import main as batch_main


def error_of(main, argv, capsys) -> tuple[str, str]:
    """(usage line, error line) of a command that argparse refuses (exit status 2)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    return err.splitlines()[0], err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, error", [
    (["batch", "in.jsonl", "-o", "out", "--bogus"],
     "nanoserve batch: error: unrecognized arguments: --bogus (see 'nanoserve batch --help')"),
    (["batch", "in.jsonl", "-o", "out", "--max-tokns", "8"],
     "nanoserve batch: error: unrecognized arguments: --max-tokns 8 "
     "(did you mean --max-tokens?)"),
    (["batch", "--bogus"],
     "nanoserve batch: error: unrecognized arguments: --bogus (see 'nanoserve batch --help'); "
     "and the following arguments are required: input, -o/--output/--output-dir"),
    (["batch", "in.jsonl", "-o", "out", "--schedular", "static"],
     "nanoserve batch: error: unrecognized arguments: --schedular static "
     "(did you mean --scheduler?)"),
    (["embed", "in.jsonl", "-o", "out", "--dimension=8", "--polling", "mean"],
     "nanoserve embed: error: unrecognized arguments: --polling mean (did you mean --pooling?)"),
    (["generate", "--max-tokns", "3", "hi"],
     "nanoserve generate: error: unrecognized arguments: --max-tokns "
     "(did you mean --max-tokens?)"),
])
def test_unknown_flag_is_the_subcommands_error(argv, error, capsys):
    usage, line = error_of(nanoserve_main, argv, capsys)
    assert usage.startswith(f"usage: nanoserve {argv[0]} ")
    assert line == error


def test_invalid_choices_name_the_closest(capsys):
    usage, line = error_of(nanoserve_main, ["btch", "in.jsonl"], capsys)
    assert usage.startswith("usage: nanoserve ") and line.endswith("(did you mean 'batch'?)")
    _, line = error_of(nanoserve_main, ["batch", "x", "-o", "y", "--scheduler", "contnuous"],
                       capsys)
    assert line.endswith("invalid choice: 'contnuous' (choose from 'auto', 'static', "
                         "'continuous') (did you mean 'continuous'?)")


def test_batch_module_alone_suggests_too(capsys):
    """`python -m ray_jobs.cli` is `nanoserve batch`: the same errors."""
    usage, line = error_of(batch_main, ["in.jsonl", "-o", "out", "--retry-erors"], capsys)
    assert usage.startswith("usage: nanoserve batch ")
    assert line == ("nanoserve batch: error: unrecognized arguments: --retry-erors "
                    "(did you mean --retry-errors?)")


def test_batch_and_embed_read_the_flags_they_share_alike():
    """`nanoserve batch` and `nanoserve embed` share their input, columns, cluster and rerun
    flags (one set of arguments, the same job options); each keeps its batch defaults."""
    from nanoserve_cli import build_parser
    from ray_jobs.cli import _job_options

    shared = ["in.jsonl", "-o", "out", "--model", "m", "--prompt-column", "p", "--id-column",
              "i", "--dtype", "float32", "--num-workers", "2", "--worker-start-timeout", "5",
              "--address", "local", "--overwrite", "--retry-errors", "--no-progress"]
    parser = build_parser()
    batch, embed = (_job_options(parser.parse_args([command, *shared]))
                    for command in ("batch", "embed"))
    assert batch == {**embed, "batch_size": 64, "max_batch_tokens": None}
    assert (embed["batch_size"], embed["max_batch_tokens"]) == (1024, 65536)
    assert embed == {"model": "m", "prompt_column": "p", "id_column": "i", "dtype": "float32",
                     "batch_size": 1024, "max_batch_tokens": 65536, "num_workers": "2",
                     "worker_start_timeout_s": 5.0, "address": "local", "overwrite": True,
                     "retry_errors": True, "progress": False}


FAST_ERROR_SCRIPT = """
import sys
from nanoserve_cli import main
rc = main(sys.argv[1:])
print("RC", rc, sorted(m for m in ("torch", "ray", "ray_jobs.dispatch.driver") if m in sys.modules))
"""
HUB_NAME_ERROR = ("error: no such model: org/no-such-model is not a file or folder here, and "
                  "nanoserve fetches no model but its default (smollm2-135m-instruct); download "
                  "the Hugging Face model into a folder first, e.g. `hf download "
                  "org/no-such-model --local-dir models/no-such-model` (huggingface_hub's "
                  "command line), and pass that folder")


@pytest.mark.parametrize("argv, error", [
    (["generate"], "error: no prompts: give them as arguments or with --file"),
    (["generate", "--model", "org/no-such-model", "hi"], HUB_NAME_ERROR),
    (["batch", "in.jsonl", "-o", "out", "--model", "org/no-such-model"], HUB_NAME_ERROR),
    (["embed", "in.jsonl", "-o", "out", "--model", "org/no-such-model"], HUB_NAME_ERROR),
])
def test_mistakes_are_said_before_the_heavy_imports(argv, error, tmp_path):
    """A missing prompt or an unknown model is one line, exit 2, before the engine (torch)
    or the job (its driver, Ray) is imported: at once, not after their seconds of imports."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", FAST_ERROR_SCRIPT, *argv], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, env=env)
    assert out.stderr.strip().splitlines() == [error]
    assert out.stdout.strip() == "RC 2 []"
