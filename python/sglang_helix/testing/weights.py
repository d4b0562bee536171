"""Per-rank weight checksums of a running server (``POST /weights_checker {"action": "checksum"}``)."""

from __future__ import annotations

import json
import urllib.request


def weight_checksums(base_url: str) -> dict:
    """``{tp_rank: {parameter name: hex hash}}`` of the target model, from every rank."""
    req = urllib.request.Request(
        base_url + "/weights_checker",
        data=json.dumps({"action": "checksum", "selector": "target"}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        body = json.load(r)
    assert body["success"], body
    out = {}
    for rank in body["ranks"]:
        # One entry per runner role whose checksums were merged into this rank's: target only.
        (info,) = rank["parallelism_info"]
        assert info["role"] == "target" and info["pp_size"] == 1, info
        out[info["tp_rank"]] = rank["checksums"]
    return out
