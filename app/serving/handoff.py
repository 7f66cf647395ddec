"""The P/D hand-off of a live router: a request's prompt and first token on its prefill
engine, then the prompt's KV to its decode engine, held by the transport until the
decode engine has loaded it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace

from app.engines.messages import TokenEvent
from app.serving.flight import EngineLost, Flight, FlightState, InvalidTransition
from app.serving.router_state import RouterContext, Take

logger = logging.getLogger(__name__)


class KvHandoff:
    """Runs the prefill stage and hands the prompt's KV over; frees it once the decode
    engine started, or the flight left."""

    def __init__(self, ctx: RouterContext) -> None:
        self.ctx = ctx

    async def prefill_stage(self, flight: Flight, take: Take) -> AsyncIterator[list[TokenEvent]]:
        """Prompt -> first token on the prefill engine (recorded by `take`), then the
        prompt's KV to the decode engine. When either fails the decode engine prefills
        the prompt (by token ids) itself, so the request goes on."""
        ctx = self.ctx
        inst = ctx.instances[flight.instance_id]
        params = None
        try:
            async for batch in inst.client.generate(flight.prefill_request()):
                params = batch[-1].kv_transfer_params or params
                kept = take(flight, self._first_token_only(flight, batch))
                if kept:
                    yield kept
        except (EngineLost, InvalidTransition):
            raise
        except Exception as exc:
            logger.warning("request %s: prefill on %s failed (%s: %s); its decode engine "
                           "prefills it", flight.request_id, inst.instance_id,
                           type(exc).__name__, exc)
            inst.healthy = False
        if flight.state is FlightState.FINISHED:
            return
        if not flight.output.token_ids:
            flight.decode_without_kv()
            ctx.flights.recount(flight)
            return
        assert ctx.kv_transport is not None and flight.kv is not None
        flight.end_prefill(ctx.clock())
        ctx.flights.recount(flight)
        try:
            handoff = await ctx.kv_transport.transfer(
                flight.route.num_prompt_tokens, inst.spec.model.kv_bytes_per_token,
                flight.kv.prefill_end_s, params)
        except Exception as exc:
            logger.warning("request %s: KV transfer failed (%s: %s); its decode engine "
                           "prefills it", flight.request_id, type(exc).__name__, exc)
            ctx.kv_transport.release(params)
            flight.decode_without_kv()
            return
        flight.hand_off(handoff.params, handoff.transfer_s)

    def on_decode_start(self, flight: Flight, batch: list[TokenEvent]) -> None:
        """The decode engine produced its first token: it has the prompt's KV (it tells
        how many tokens it found rather than computed); the hand-off can be freed."""
        kv = flight.kv
        assert kv is not None
        kv.loaded_tokens = batch[0].num_cached_tokens or 0
        if kv.transfer_s is None and kv.prefill_end_s is not None:
            kv.transfer_s = self.ctx.clock() - kv.prefill_end_s  # load included
        if kv.transfer_s is not None:
            per_token = self.ctx.instances[flight.instance_id].spec.model.kv_bytes_per_token
            self.ctx.metrics.kv_transferred(kv.transfer_s,
                                            flight.route.num_prompt_tokens * per_token)
        self.release(flight)

    def release(self, flight: Flight) -> None:
        """Free the KV the transport holds for the flight, when it holds any."""
        if flight.kv is not None and flight.kv.held and self.ctx.kv_transport is not None:
            flight.kv.held = False
            self.ctx.kv_transport.release(flight.kv.params)

    @staticmethod
    def _first_token_only(flight: Flight, batch: list[TokenEvent]) -> list[TokenEvent]:
        """The prefill engine stops at one token by its own max_tokens; that ends the
        request only when the client asked for one token (an EOS always ends it)."""
        if flight.request.sampling.max_tokens == 1:
            return batch
        return [replace(ev, finish_reason=None) if ev.finish_reason == "length" else ev
                for ev in batch]
