"""Ledger totals and reconciliation (`keepstate ledger reconcile`): every way the ledger could disagree with the
stored responses, the budgets, or a provider's own count is reported as a Mismatch."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from keepstate.db.repos.ledger import Ledger
from keepstate.gateway.prices import PriceTable
from keepstate.gateway.usage import from_stored

TOKEN_FIELDS = ("input_tokens", "output_tokens", "cached_tokens", "cache_write_tokens", "reasoning_tokens")


@dataclass(frozen=True, slots=True)
class Mismatch:
    check: str
    subject: str
    detail: str

    def to_dict(self) -> dict[str, str]:
        return {"check": self.check, "subject": self.subject, "detail": self.detail}


def totals(entries: list[dict[str, Any]]) -> dict[str, Any]:
    upstream = [e for e in entries if e["kind"] == "upstream"]
    out: dict[str, Any] = {
        "entries": len(entries),
        "upstream_calls": len(upstream),
        "served_from_store": sum(1 for e in entries if e["kind"] in ("store", "joined")),
        "cost_usd": sum(e["cost_nano"] for e in entries) / 1e9,
    }
    for f in TOKEN_FIELDS:
        out[f] = sum(e[f] for e in upstream)
    return out


async def reconcile(
    ledger: Ledger, prices: PriceTable, provider_counts: dict[str, dict[str, Any]] | None = None
) -> list[Mismatch]:
    """`provider_counts`: provider name -> its own count ({"requests", "calls", "input_tokens", "output_tokens"})."""
    out: list[Mismatch] = []
    entries = await ledger.entries()
    by_id = {e["entry_id"]: e for e in entries}
    ok_by_call: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in entries:
        if e["kind"] == "upstream" and e["outcome"] == "ok":
            ok_by_call[e["call_key"]].append(e)
        elif e["kind"] in ("store", "joined") and e["outcome"] == "ok":
            if e["original_entry_id"] not in by_id:
                out.append(Mismatch("original", f"entry {e['entry_id']}",
                                    f"{e['kind']} entry points at missing entry {e['original_entry_id']}"))
        if e["kind"] == "upstream" and not e["priced"]:
            out.append(Mismatch("price", f"entry {e['entry_id']}", f"model {e['model']} has no price"))

    for call in await ledger.calls():
        oks = ok_by_call.get(call.call_key, [])
        if call.status == "interrupted":
            out.append(Mismatch("outcome", call.call_key, "interrupted: the provider may have billed it (unknown)"))
        if call.status == "done" and len(oks) != 1:
            out.append(Mismatch("once", call.call_key, f"done call has {len(oks)} successful upstream entries"))
        if call.status == "done" and oks and call.response is not None:
            parsed = from_stored(call.endpoint, call.stream, call.response)
            entry = oks[-1]
            if parsed is None:
                out.append(Mismatch("usage", call.call_key, "stored response carries no usage"))
                continue
            for f in TOKEN_FIELDS:
                if getattr(parsed, f) != entry[f]:
                    out.append(Mismatch("usage", call.call_key,
                                        f"{f}: ledger {entry[f]}, stored response {getattr(parsed, f)}"))
            cost = prices.cost_nano(entry["model"], parsed)
            if cost is not None and entry["priced"] and cost != entry["cost_nano"]:
                out.append(Mismatch("cost", call.call_key,
                                    f"ledger {entry['cost_nano']} nUSD, current price table {cost} nUSD"))

    spent: dict[tuple[str, str], int] = defaultdict(int)
    for e in entries:
        spent[("session", e["session_id"])] += e["cost_nano"]
        if e["api_key_id"]:
            spent[("key", e["api_key_id"])] += e["cost_nano"]
    for b in await ledger.budgets():
        scope = (b["scope"], b["ident"])
        if b["reserved_nano"] and not await ledger.any_inflight():
            out.append(Mismatch("budget", f"{b['scope']} {b['ident']}",
                                f"{b['reserved_nano']} nUSD still reserved with no call in flight"))
        # Spent may exceed the ledger (an interrupted call is charged its whole reservation), never fall short.
        if b["spent_nano"] < spent[scope]:
            out.append(Mismatch("budget", f"{b['scope']} {b['ident']}",
                                f"spent {b['spent_nano']} nUSD, ledger says {spent[scope]} nUSD"))
        if b["spent_nano"] > b["limit_nano"]:
            out.append(Mismatch("budget", f"{b['scope']} {b['ident']}",
                                f"spent {b['spent_nano']} nUSD over the limit {b['limit_nano']} nUSD"))

    for name, count in (provider_counts or {}).items():
        mine = [e for e in entries if e["kind"] == "upstream" and e["provider"] == name]
        ok = [e for e in mine if e["outcome"] == "ok"]
        pairs = [
            ("requests", len(mine), count.get("requests")),
            ("calls", len(ok), count.get("calls")),
            ("input_tokens", sum(e["input_tokens"] for e in ok), count.get("input_tokens")),
            ("output_tokens", sum(e["output_tokens"] for e in ok), count.get("output_tokens")),
        ]
        for what, ours, theirs in pairs:
            if theirs is not None and ours != theirs:
                out.append(Mismatch("provider", name, f"{what}: ledger {ours}, provider {theirs}"))
    return out

