"""The faults harness tells a proxy's own 404 (the request never reached the
application, so it is sent again) from the application's OpenAI 404."""

from __future__ import annotations

import httpx
import pytest

from app.experiments.faults import unrouted

pytestmark = pytest.mark.unit


def test_only_a_proxys_own_404_counts_as_unrouted():
    proxy = httpx.Response(404, text="Path '/v1/completions' not found. Ping "
                                     "http://.../-/routes for available routes.")
    app = httpx.Response(404, json={"error": {"message": "the model 'x' does not exist",
                                              "type": "not_found_error"}})
    assert unrouted(proxy)
    assert not unrouted(app)
    assert not unrouted(httpx.Response(200, text="Path '/' is fine"))
