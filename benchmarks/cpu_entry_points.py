"""The CPU engine's speed in each entry point, on the same rows, under the same load: `nanoserve
generate` (the command), `LLM.generate` (the Python API) and a batch job's Ray worker.

The rows: `--prompts` chat prompts (the user's message, the default model's chat template),
`--max-tokens` tokens each, greedy, on the default model; every entry point runs them as one
call, so each gets the same tokens. What is compared is the time per generated token of the
generation alone (no imports, no model load, no Ray start):
- `generate`: `python -m nanoserve_cli generate --chat ... --max-tokens N`, its stderr line
  (`nanoserve: T tokens for P prompt(s) in S s ...`);
- `LLM.generate`: a fresh process that imports nanoserve, loads `LLM()` and times
  `generate` on the same token ids;
- `worker`: `nanoserve batch` on a JSON Lines file of the same rows (`messages`): the time
  its worker's engine had rows to run (`busy_s` of the job report's worker, what
  `LLM.generate`'s time is in the other two), and beside it the job's generation phases
  (the summary's `generation: S s`: the engine's time plus the worker's reading, preparing
  and writing of the batch, and the driver's collecting of it);
- and, as before the threading set-up was shared, the same two without it: `generate` and
  `LLM.generate` in a process that imports torch before nanoserve, so OpenMP's threads keep
  their default (spinning) wait policy (`--no-before` leaves these out).
Runs alternate between the entry points, `--repeats` times, while `--load` busy processes run
(`benchmarks.job_start.busy_load`); the table gives each run's seconds per token, then the
medians and their ratio to the worker's.

    python -m benchmarks.cpu_entry_points --prompts 1 --max-tokens 32 --repeats 3 --load 4
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, cpu_model_name, git_commit, load_average, markdown_table
from benchmarks.job_start import busy_load

PROMPTS = ["Write a long story about a lighthouse keeper and the sea.",
           "Explain in detail how a steam engine works.",
           "Describe a walk through a forest in autumn.",
           "List the planets of the solar system and describe each one."]

API = r"""
import json, sys, time
{before}
import nanoserve
from nanoserve.llm import LLM
from nanoserve.sampling.params import SamplingParams
prompts, max_tokens = json.loads(sys.argv[1]), int(sys.argv[2])
llm = LLM()
ids = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{{"role": "user", "content": p}}]))
       for p in prompts]
t = time.perf_counter()
outs = llm.generate(ids, SamplingParams(max_tokens=max_tokens))
s = time.perf_counter() - t
print("RESULT=" + json.dumps({{"s": s, "tokens": sum(len(o.token_ids) for o in outs)}}))
"""
CLI = r"""
import sys
{before}
from nanoserve_cli import main
sys.exit(main(sys.argv[1:]))
"""


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "OMP_WAIT_POLICY")}
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return e


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env())
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} failed:\n{p.stderr[-3000:]}")
    return p


def generate_cli(prompts: list[str], max_tokens: int, before: bool) -> dict:
    p = run([sys.executable, "-c", CLI.format(before="import torch" if before else ""),
             "generate", "--chat", "--max-tokens", str(max_tokens), *prompts])
    m = re.search(r"nanoserve: (\d+) tokens for \d+ prompt\(s\) in (\d+\.\d+) s",
                  p.stderr)
    if m is None:
        raise SystemExit(f"no rate line from generate:\n{p.stderr[-2000:]}")
    return {"tokens": int(m.group(1)), "s": float(m.group(2))}


def generate_api(prompts: list[str], max_tokens: int, before: bool) -> dict:
    p = run([sys.executable, "-c", API.format(before="import torch" if before else ""),
             json.dumps(prompts), str(max_tokens)])
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT="))
    return json.loads(line.removeprefix("RESULT="))


def worker(prompts: list[str], max_tokens: int, tmp: Path) -> dict:
    rows = tmp / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n"
                            for p in prompts))
    p = run([sys.executable, "-m", "nanoserve_cli", "batch", str(rows), "-o", str(tmp / "out"),
             "--overwrite", "--max-tokens", str(max_tokens), "--no-progress", "--address",
             "local"])
    tokens = int(re.search(r"^tokens: \d+ input, (\d+) output", p.stdout, re.M).group(1))
    m = re.search(r"\(generation: (\d+\.\d+) s", p.stdout)
    if m is None:
        raise SystemExit(f"no generation time in the summary:\n{p.stdout}")
    report = (tmp / "out" / "_nanoserve_report.html").read_text()
    data = json.loads(re.search(r'<script type="application/json" id="nanoserve-report-data">'
                                r"(.*?)</script>", report, re.S).group(1))
    return {"tokens": tokens, "s": sum(w["busy_s"] for w in data["workers"]),
            "phase_s": float(m.group(1))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=1, help=f"1-{len(PROMPTS)} (default 1)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--load", type=int, default=4, help="busy processes (default: 4)")
    ap.add_argument("--no-before", dest="before", action="store_false",
                    help="leave out the runs without the shared threading set-up")
    args = ap.parse_args()
    prompts = PROMPTS[:args.prompts]
    sides = {"generate": lambda tmp: generate_cli(prompts, args.max_tokens, False),
             "LLM.generate": lambda tmp: generate_api(prompts, args.max_tokens, False),
             "worker": lambda tmp: worker(prompts, args.max_tokens, tmp)}
    if args.before:
        sides["generate, torch first"] = lambda tmp: generate_cli(prompts, args.max_tokens, True)
        sides["LLM.generate, torch first"] = lambda tmp: generate_api(prompts, args.max_tokens,
                                                                      True)
    print(f"commit: {git_commit()}; machine: {os.cpu_count()}-core {cpu_model_name()}; "
          f"{len(prompts)} prompt(s), {args.max_tokens} tokens each, greedy; load: "
          f"{args.load} busy processes")
    print(f"load average before the load (1/5/15 min): {load_average()}")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ns-entry-") as tmp, busy_load(args.load):
        time.sleep(5)
        for i in range(args.repeats):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for name in order:
                load = os.getloadavg()[0]
                r = sides[name](Path(tmp))
                runs.append({"run": i + 1, "side": name, "load1": load, **r,
                             "s_per_token": r["s"] / max(r["tokens"], 1)})
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
        print(f"load average at the end, load still running (1/5/15 min): {load_average()}")
    print()
    print(markdown_table(["run", "entry point", "tokens", "engine (s)", "s/token",
                          "job's generation phases (s)", "load (1 min)"],
                         [[r["run"], r["side"], r["tokens"], f"{r['s']:.2f}",
                           f"{r['s_per_token']:.3f}",
                           f"{r['phase_s']:.2f}" if "phase_s" in r else "",
                           f"{r['load1']:.1f}"] for r in runs]))
    med = {name: statistics.median(r["s_per_token"] for r in runs if r["side"] == name)
           for name in sides}
    print()
    print(markdown_table(["entry point", "median s/token", "over the worker's"],
                         [[name, f"{med[name]:.3f}", f"{med[name] / med['worker']:.2f}"]
                          for name in sides]))


if __name__ == "__main__":
    main()
