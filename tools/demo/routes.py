"""The expert ids a target's MoE layers choose in one call: what the demo's router-bias update counts."""

from __future__ import annotations

from typing import Callable

from flax import nnx

from eagle3_jax.models.moe import MoE


def set_route_recording(model: nnx.Module, on: bool = True) -> None:
    """Makes every MoE layer of ``model`` sow (or stop sowing) its chosen expert ids per call."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, MoE):
            module.record_routes = on


def capture_routes(fn: Callable) -> Callable:
    """Wraps ``fn(model, *args)`` to return ``(result, expert ids)`` of that call: one [M, K] int32
    array per MoE call, by ascending layer index. Recording is on only for the call."""
    captured = nnx.capture(fn, nnx.Intermediate)

    def wrapped(model, *args, **kwargs):
        set_route_recording(model, True)
        try:
            result, sown = captured(model, *args, **kwargs)
        finally:
            set_route_recording(model, False)
        routes = [ids for path, var in nnx.to_flat_state(sown) if path[-1] == "expert_ids"
                  for ids in var.get_value()]
        return result, routes

    return wrapped
