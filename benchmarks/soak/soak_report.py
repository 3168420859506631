"""The soak's markdown report (soak.py writes it beside its JSON)."""

from __future__ import annotations


def markdown(r: dict) -> str:
    t, rss, kv = r["tally"], r["rss_mib"], r["kv_blocks"]
    a = r["args"]
    lines = [
        f"# Soak: {r['label']}",
        "",
        f"`{r.get('command') or 'python3 benchmarks/soak/soak.py'}` on `{a['model']}`: {a['clients']} concurrent "
        f"streaming clients (closed loop, the server's saturation rate), ~{a['disconnect_frac']:.0%} dropped "
        f"mid-stream, ~{a['bad_frac']:.0%} bad requests; good requests ask for "
        f"{a['max_tokens'] // 4}..{a['max_tokens']} tokens; ~{a.get('costly_frac', 0):.0%} the amplification "
        f"classes of costly_requests.py (grammar cache {a.get('grammar_cache_mb') or 'default'} MB)"
        + (f"; p99 latency compared with `{r['baseline']}`." if r.get("baseline") else "."),
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {' '.join(m['isa_flags'])}." if (m := r.get("machine")) else "",
        "",
        f"**{'PASSED' if r['passed'] else 'FAILED'}** in {r['duration_s']:.0f} s of load "
        f"(server start {r['server_startup_s']:.0f} s).",
        "",
        "| check | result |",
        "|---|---|",
        *(f"| {k} | {'ok' if v else '**FAILED**'} |" for k, v in r["checks"].items()),
        "",
        "| measure | value |",
        "|---|---|",
        f"| good streams completed | {t['good_ok']} / {t['good']} |",
        f"| good requests answered 5xx / stream error events | {t['good_5xx']} / {t['good_stream_errors']} |",
        f"| good requests, other status / transport errors | {t['good_other_status'] or 0} / "
        f"{t['good_transport_errors']} |",
        f"| streams dropped mid-stream by the client | {t['disconnects']} |",
        f"| bad requests: 4xx / 5xx | {t['bad_4xx']} / {t['bad_5xx']} of {t['bad']} |",
        f"| requests/s (all kinds) | {r['requests_per_s']} |",
        f"| completion tokens/s (completed streams) | {r['completion_tokens_per_s']} |",
        f"| time to first token p50 / p99 | {r['ttft_s']['p50']} s / {r['ttft_s']['p99']} s |",
        f"| good stream latency p50 / p99 | {r['latency_s']['p50']} s / {r['latency_s']['p99']} s |",
        f"| amplification requests sent / answered off contract | {sum(t['costly'].values())} / "
        f"{t['costly_unexpected']} |",
        *(f"| &nbsp; {k} | {v} |" for k, v in sorted(t["costly"].items())),
        f"| KV blocks leaked once idle | {kv['leaked']} of {kv['total']} |",
        f"| server RSS start / max / end | {rss['start']} / {rss['max']} / {rss['end']} MiB |",
        f"| RSS slope after the first {rss['warmup_s']:.0f} s | {rss['slope_mib_per_min_after_warmup']} MiB/min |",
    ]
    if t["examples"]:
        lines += ["", "First failures:", "", *(f"- `{e}`" for e in t["examples"])]
    return "\n".join(lines) + "\n"
