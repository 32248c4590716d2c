"""`k3verify gsm8k`: lm-eval's gsm8k task on the embedded model or an endpoint, and the paired gate.

Without --toggle it measures the reference path (or --base-url through lm-eval's
local-completions model). With --toggle T the same questions and prompts (same
few-shot seed) are answered again with T applied, joined per question (doc_id and
lm-eval's prompt hash) and judged by the paired test at --margin (k3verify.quality.stats):
pass, fail, or inconclusive when n cannot resolve the margin; never a raw score
compare. Exit 0 pass, 1 fail or inconclusive (a gate that could not decide lets
nothing through; the last line says what n would), 2 bad input. --smoke marks the
results as a smoke test: an inconclusive smoke exits 0 and counts toward no toggle
verdict; a failing one still exits 1. Writes DIR/report.json (per filter accuracy,
per-question outcomes, the paired result with its MDE), .md, .html, junit.xml.
"""
from __future__ import annotations

from pathlib import Path

from rich.table import Table

from k3verify.commands import add_device_flag, add_json_flag, add_model_flag, device_load_options, console, emit_json, model_load_options

NAME = "gsm8k"
HELP = "GSM8K through lm-eval (5-shot, strict and flexible); with --toggle the paired non-inferiority gate"


def add_arguments(parser) -> None:
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="first N test questions (default: all)")
    parser.add_argument("--dataset", choices=("gsm8k", "synth"), default="gsm8k",
                        help="gsm8k (Hugging Face openai/gsm8k, or --data-dir) or synth (seeded gsm8k-synth)")
    parser.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                        help="local train.jsonl + test.jsonl instead of the Hugging Face hub (offline)")
    parser.add_argument("--base-url", default=None, metavar="URL",
                        help="OpenAI-compatible endpoint (http://host:port/v1) run through lm-eval's local-completions")
    parser.add_argument("--model-name", default=None, metavar="NAME",
                        help="model name sent to --base-url (default: the first id from its /models)")
    parser.add_argument("--toggle", default=None, metavar="T", help="candidate toggle judged against the reference")
    parser.add_argument("--num-fewshot", type=int, default=5, metavar="K", help="few-shot examples (default 5)")
    parser.add_argument("--fewshot-seed", type=int, default=1234, metavar="S",
                        help="lm-eval's few-shot sampling seed, the same for both sides (default 1234)")
    parser.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                        help="generation budget per question (default 256, lm-eval's)")
    parser.add_argument("--margin", type=float, default=0.01,
                        help="non-inferiority margin as a fraction (default 0.01 = 1 point)")
    parser.add_argument("--alpha", type=float, default=0.05, help="one-sided alpha (default 0.05)")
    parser.add_argument("--beta", type=float, default=0.2, help="1 - power for the stated MDE (default 0.2)")
    parser.add_argument("--min-accuracy", type=float, default=None, metavar="A",
                        help="without --toggle: fail a filter whose accuracy is below A (fraction)")
    parser.add_argument("--smoke", action="store_true",
                        help="a smoke test: the pipeline runs end to end; its pass or inconclusive counts toward "
                             "no verdict (a fail still fails)")
    parser.add_argument("--report-dir", type=Path, help="where to write the report (default reports/<run-id>)")
    add_model_flag(parser)
    add_device_flag(parser)
    add_json_flag(parser)


def spec_of(args):
    """The flags as a gsm8k CheckSpec (kinds/gsm8k.py validates every value, spelled as flags)."""
    from k3verify.errors import UsageError
    from k3verify.kinds.base import CheckSpec

    if args.base_url is not None and args.model is not None:
        raise UsageError("--model picks the embedded model; with --base-url use --model-name")
    return CheckSpec(NAME, options={
        "toggles": None if args.toggle is None else [args.toggle], "dataset": args.dataset, "limit": args.limit,
        "data_dir": None if args.data_dir is None else str(args.data_dir), "base_url": args.base_url,
        "model_name": args.model_name, "num_fewshot": args.num_fewshot, "fewshot_seed": args.fewshot_seed,
        "max_new_tokens": args.max_new_tokens, "margin": args.margin, "alpha": args.alpha, "beta": args.beta,
        "min_accuracy": args.min_accuracy, "smoke": args.smoke})


def summary_table(results: list[dict]) -> Table:
    table = Table(title=f"gsm8k {results[0]['scenario']}")
    for col in ("toggle", "filter", "reference", "candidate", "b", "c", "McNemar p", "bound", "MDE", "status"):
        table.add_column(col)
    for r in results:
        acc = r["accuracy"]
        if isinstance(acc, dict):
            cells = [f"{acc['acc_ref']:.4f}", f"{acc['acc_cand']:.4f}", str(acc["b"]), str(acc["c"]),
                     f"{acc['mcnemar_p']:.3g}", f"{acc['lower_bound']:+.4f}"]
        else:
            cells = [f"{acc[0]['value']:.4f}", "-", "-", "-", "-", "-"]
        colour = {"pass": "green", "inconclusive": "yellow"}.get(r["status"], "red")
        status = r["status"] + (" (smoke)" if r.get("role") == "smoke" else "")
        table.add_row(r["toggle"], r["filter"], *cells, f"{100 * r['mde']:.2f} pts", f"[{colour}]{status}[/]")
    return table


def verdict_line(verdict: str, results: list[dict]) -> str:
    """'verdict: inconclusive: n=2 cannot resolve ...': the run's verdict and, unless a pass, why."""
    why = [r["accuracy"]["verdict_reason"] for r in results
           if isinstance(r["accuracy"], dict) and r["status"] in ("fail", "inconclusive")]
    # "inconclusive: n=2 ..." under "verdict: inconclusive" would say the word twice
    why = [w[len(verdict) + 2:] if w.startswith(verdict + ": ") else w for w in why]
    smoke = any(r.get("role") == "smoke" for r in results)
    text = f"verdict: {verdict}" + (" (smoke test)" if smoke else "")
    return text + (f": {'; '.join(dict.fromkeys(why))}" if why else "")


def run(args) -> int:
    from k3verify.commands import _check
    from k3verify.commands._progress import Item
    from k3verify.kinds import gsm8k as kind
    from k3verify.kinds.base import Context

    spec = spec_of(args)
    (unit,) = _check.plan(spec)
    model = None
    if args.base_url is None:
        from optimized_stack import load_model
        model = load_model(args.model, **device_load_options(args), **model_load_options(args))
    o = spec.options
    items = [Item("question", NAME, kind.question_s(o))] * (kind.questions(o) * (2 if args.toggle else 1))
    with Context(model, model_arg=args.model, load_options=model_load_options(args)) as ctx:
        results = _check.run_units([unit], ctx, NAME, items=items)
    run_id, report, paths = _check.write(NAME, args.report_dir, model, results,
                                         seeds={"fewshot_seed": args.fewshot_seed})
    rows = report["results"]
    con = console()
    con.print(summary_table(rows))
    meta = rows[0]["gsm8k"]
    ref, cand = meta["reference"], meta["candidate"]
    where = (f"{rows[0]['endpoint']['model_name']} @ {args.base_url}" if args.base_url
             else "embedded " + (args.model or "default model"))
    con.print(f"{where}: {ref['n']} questions, {ref['seconds']:.1f} s reference "
              f"({ref['seconds_per_question']:.2f} s/question)"
              + (f", {cand['seconds']:.1f} s candidate" if cand else ""))
    for r in rows:
        if isinstance(r["accuracy"], dict):
            con.print(f"{r['filter']}: {r['reason']}")
    verdict = report["summary"]["verdict"]
    con.print(f"report: {paths['md']}")
    con.print(verdict_line(verdict, rows), soft_wrap=True)
    if args.json:
        emit_json({"run_id": run_id, "verdict": verdict, "verdict_line": verdict_line(verdict, rows),
                   "report": str(paths["json"]), "accuracy": _accuracy(rows), "paired": _paired(rows)})
    return 0 if verdict == "pass" else 1


def _accuracy(rows: list[dict]) -> dict:
    """{"reference": {filter: accuracy}, "candidate": {filter: accuracy} | None}."""
    paired = isinstance(rows[0]["accuracy"], dict)
    ref = {r["filter"]: r["accuracy"]["acc_ref"] if paired else r["accuracy"][0]["value"] for r in rows}
    return {"reference": ref, "candidate": {r["filter"]: r["accuracy"]["acc_cand"] for r in rows} if paired else None}


def _paired(rows: list[dict]) -> dict:
    return {r["filter"]: r["accuracy"] for r in rows if isinstance(r["accuracy"], dict)}
