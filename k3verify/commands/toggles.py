"""`k3verify toggles`: the registry of optimizations and mutants with their contracts."""
from __future__ import annotations

from rich.table import Table

from k3verify.commands import add_json_flag, console, emit_json

NAME = "toggles"
HELP = "list optimization toggles and seeded-fault mutants with their contracts"


def add_arguments(parser) -> None:
    parser.add_argument("--kind", choices=("optimization", "mutant"), help="only this kind")
    add_json_flag(parser)


def run(args) -> int:
    from optimized_stack import toggles as registry

    items = registry.all_toggles(args.kind)
    table = Table(title=f"{len(items)} toggles")
    for col in ("name", "kind", "contract", "touches", "where", "description"):
        table.add_column(col, overflow="fold")
    for t in items:
        where = ",".join(t.devices) + (f" ws={','.join(map(str, t.world_sizes))}" if t.world_sizes != (1,) else "")
        extra = f" [mutant of {t.mutant_of}; caught by {','.join(t.caught_by)}]" if t.kind == "mutant" else ""
        table.add_row(t.name, t.kind, t.contract.describe(), ",".join(t.touches), where, t.description + extra)
    console().print(table)
    if args.json:
        emit_json([t.to_dict() for t in items])
    return 0
