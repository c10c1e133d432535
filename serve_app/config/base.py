"""What every section of the schema shares: the strict base model and readable validation errors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError


class _Strict(BaseModel):
    """Unknown fields are errors (a typo fails at deploy time, naming the field) and a loaded
    config is immutable. Package-private: the section modules derive from it."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def format_validation_error(err: ValidationError, root: str = "") -> str:
    """One line per problem: ``models.0.engine.max_num_seqs: Input should be greater than 0 (got 0)``."""
    lines = []
    errs = err.errors()
    locs = [tuple(e["loc"]) for e in errs]
    for e in errs:
        loc_t = tuple(e["loc"])
        # A container that fails only because an item failed adds nothing ("at least 1 item").
        if any(len(o) > len(loc_t) and o[: len(loc_t)] == loc_t for o in locs):
            continue
        loc = ".".join(str(p) for p in (root, *e["loc"]) if p != "")
        msg = e["msg"].removeprefix("Value error, ")
        got = e.get("input")
        shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
        lines.append(f"{loc or '<root>'}: {msg}{shown}")
    return "\n".join(lines)

