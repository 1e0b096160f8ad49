"""A list flag is given the same way in `nanoserve batch` and `nanoserve generate`: once per
value (`--choice A --choice B`), a form that cannot take an input file or a prompt for a
choice. The form that once took a list (`--choice A B`) is one clear error in both, never
an input eaten or a word read as a prompt. Parsing only: nothing runs."""

from __future__ import annotations

import pytest

from nanoserve_cli import build_parser
from nanoserve_cli import main as nanoserve_main
from ray_jobs.cli import main as batch_main


def refused(main, argv, capsys) -> str:
    """The one error line of a command line argparse refuses (exit status 2)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv", [
    ["batch", "in.jsonl", "-o", "out", "--choice", "A", "--choice", "B"],
    ["batch", "--choice", "A", "--choice", "B", "in.jsonl", "-o", "out"],
    ["batch", "-o", "out", "--choice", "A", "--choice=B", "in.jsonl"],
])
def test_batch_takes_the_flag_once_per_choice_wherever_the_input_is(argv):
    args = build_parser().parse_args(argv)
    assert (args.choice, args.input, args.output_dir) == (["A", "B"], "in.jsonl", "out")


@pytest.mark.parametrize("argv", [
    ["generate", "Q", "R", "--choice", "yes", "--choice", "no"],
    ["generate", "--choice", "yes", "--choice", "no", "Q", "R"],
])
def test_generate_takes_the_flag_the_same_way(argv):
    args = build_parser().parse_args(argv)
    assert (args.choice, args.prompts) == (["yes", "no"], ["Q", "R"])


@pytest.mark.parametrize("argv, value, word", [
    (["batch", "--choice", "A", "B", "in.jsonl", "-o", "out"], "A", "B"),  # once ate INPUT
    (["batch", "in.jsonl", "-o", "out", "--choice", "A", "B"], "A", "B"),
    (["batch", "--choice", "A", "B", "-o", "out"], "A", "B"),  # B would be INPUT, silently
    (["generate", "--choice", "yes", "no", "Q"], "yes", "no"),  # 'no' would be a prompt
    (["generate", "Q", "--choice", "yes", "no"], "yes", "no"),
])
def test_the_old_list_form_is_one_clear_error_in_both(argv, value, word, capsys):
    line = refused(nanoserve_main, argv, capsys)
    assert line == (f"nanoserve {argv[0]}: error: --choice takes one value: give the flag once "
                    f"for each (--choice {value} --choice {word}); '{word}' after --choice "
                    f"{value} would be read as another argument")


def test_the_batch_module_alone_refuses_it_too(capsys):
    line = refused(batch_main, ["--choice", "A", "B", "in.jsonl", "-o", "out"], capsys)
    assert line.startswith("nanoserve batch: error: --choice takes one value")


def test_help_gives_the_one_form(capsys):
    for command in ("batch", "generate"):
        with pytest.raises(SystemExit):
            nanoserve_main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "the flag once for each choice, --choice" in text, command
