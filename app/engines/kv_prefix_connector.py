"""vLLM's shared-storage KV connector, also loading a stored prefix of a longer prompt.

vLLM's ExampleConnector stores each new prompt's KV (its whole blocks but a last full
one) under a hash of those token ids, and loads it for a prompt of exactly that plus
one token: the P/D hand-off. A request moved with its KV reaches its target as prompt +
the tokens generated so far, so the stored KV is of a prefix, which the stock connector
never looks up. The router names it in the submission's `kv_transfer_params`
(`{"kv_prefix_tokens": n}`, n a whole number of blocks): this connector loads those n
tokens, the engine computes the rest (the generated tokens and the prompt's last
block), and the moved prompt itself is not stored again. Without the parameter it is
the stock connector.

Loaded in the engine process by vLLM's connector factory (`kv_connector_module_path`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)

from app.engines.messages import KV_PREFIX_PARAM


class PrefixLoadingConnector(ExampleConnector):
    """ExampleConnector that also loads the stored KV of a prompt's first n tokens."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prefix_loads: dict[str, tuple[Any, int]] = {}  # req id -> (request, n)
        self._no_store: set[int] = set()  # id() of moved prompts' token lists

    def named_prefix(self, request: Any) -> int | None:
        """The prefix length the router asked to load, when it is a usable one."""
        params = request.kv_transfer_params or {}
        n = params.get(KV_PREFIX_PARAM)
        prompt_len = len(request.prompt_token_ids or ())
        if (not isinstance(n, int) or isinstance(n, bool) or n <= 0
                or n % self._block_size or n >= prompt_len):
            return None
        return n

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        n = self.named_prefix(request)
        if n is None:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        prompt = list(request.prompt_token_ids)
        folder = self._generate_foldername_debug(
            torch.tensor(prompt[:n]), [f.identifier for f in request.mm_features],
            create_folder=False)
        if n <= num_computed_tokens or not os.path.isdir(folder):
            return 0, False  # nothing to load: the engine computes the prompt
        self._prefix_loads[request.request_id] = (request, n)
        return n - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        if request.request_id not in self._prefix_loads:
            super().update_state_after_alloc(request, blocks, num_external_tokens)
        elif num_external_tokens == 0:
            del self._prefix_loads[request.request_id]

    def build_connector_meta(self, scheduler_output: Any) -> ExampleConnectorMetadata:
        loads = []
        for new_req in scheduler_output.scheduled_new_reqs:
            found = self._prefix_loads.pop(new_req.req_id, None)
            if found is not None:
                loads.append((new_req.prompt_token_ids, new_req.block_ids[0],
                              new_req.mm_features, found[1]))
                self._no_store.add(id(new_req.prompt_token_ids))
        try:
            meta = super().build_connector_meta(scheduler_output)
        finally:
            self._no_store.clear()
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # preempted, loading again
            found = self._prefix_loads.pop(req_id, None)
            if found is not None and req_id in cached.resumed_req_ids:
                request, n = found
                loads.append((request.prompt_token_ids, cached.new_block_ids[i][0],
                              request.mm_features, n))
        for token_ids, block_ids, mm_features, n in loads:
            # make_meta keeps (len - 1) // block x block tokens: n of them
            meta.add_request(token_ids=list(token_ids[:n + 1]), block_ids=block_ids,
                             block_size=self._block_size, is_store=False,
                             mm_hashes=[f.identifier for f in mm_features])
        return meta

    def _found_match_for_prompt(self, prompt_token_ids: list[int],
                                mm_hashes: list[str]) -> bool:
        """A moved prompt counts as stored, so it is not stored again (its prefix was)."""
        if id(prompt_token_ids) in self._no_store:
            return True
        return super()._found_match_for_prompt(prompt_token_ids, mm_hashes)
