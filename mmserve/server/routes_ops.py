"""Operations endpoints: /health (and its alias /ping), /metrics, /version. None needs the API key."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

import mmserve
from mmserve.server.app_state import AppState, app_state

router = APIRouter()
State = Annotated[AppState, Depends(app_state)]
HEALTH_TIMEOUT_S = 2.0  # how long /health waits for the engine's answer
METRICS_PING_TIMEOUT_S = 1.0  # /metrics waits this long for fresh engine stats, else shows the last ones


@router.get("/health")
async def health(state: State, check_integrity: bool = False):
    """200 while the engine answers: `{"status": "ok"}`, or "degraded" with the reasons while some encoder
    worker is down or restarting (the others and the engine's tower serve meanwhile). `?check_integrity=true`
    also checks the engine's KV pool, prefix cache and embedding cache invariants (500 if broken) and reports
    their occupancy."""
    stats = await state.client.ping(timeout_s=HEALTH_TIMEOUT_S, check_integrity=check_integrity)
    if stats is None:
        return JSONResponse({"status": "unhealthy", "reason": "engine did not answer"}, status_code=503)
    up = _serving_status(state)
    if not check_integrity:
        return up
    body = {
        **up,
        "status": up["status"] if stats.integrity_error == "" else "corrupt",
        "integrity_error": stats.integrity_error or None,
        "kv_slots_used": stats.kv_slots_used,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "in_flight": state.client.num_in_flight,
        "parts_received": stats.parts_received,
        "parts_dropped": stats.parts_dropped,
        "parts_forged": stats.parts_forged,
        "parts_replayed": stats.parts_replayed,
        "transfer_held_bytes": stats.transfer_held_bytes,
        "kv_handoffs": stats.kv_handoffs,
        "kv_handoff_failures": stats.kv_handoff_failures,
        "kv_bytes": stats.kv_bytes,
        "kv_pending": stats.kv_pending,
    }
    return JSONResponse(body, status_code=200 if stats.integrity_error == "" else 500)


def _serving_status(state: AppState) -> dict:
    """{"status": "ok"}, or "degraded" naming the encoder workers that are down or restarting."""
    workers = state.encoder_workers
    problems = workers.problems if workers is not None else []
    if not problems:
        return {"status": "ok"}
    return {
        "status": "degraded",
        "reasons": problems,
        "encoder_workers": [w.as_json() for w in workers.states],
    }


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(state: State):
    """vLLM's (and SageMaker's) liveness probe: the same answer as /health."""
    return await health(state)


@router.get("/version")
async def version():
    return {"version": mmserve.__version__}


@router.get("/metrics")
async def prometheus(state: State):
    fresh = await state.client.ping(timeout_s=METRICS_PING_TIMEOUT_S)
    state.metrics.update_engine(fresh or state.client.stats)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")
