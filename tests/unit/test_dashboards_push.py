"""`goodserve dashboards push` against a local server that answers as Grafana's HTTP
API documents it (folders, datasources by uid, dashboards/db, bearer tokens). No
Grafana server can be installed on these machines, so this server checks each request
the way the documentation says Grafana does, and keeps what was provisioned."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from app.cli import cli
from deployments.dashboards import DASHBOARDS, DATASOURCE_UID, FOLDER_UID

pytestmark = pytest.mark.unit

TOKEN = "glsa_test_token_not_to_be_printed"


class GrafanaState:
    def __init__(self) -> None:
        self.folders: dict[str, dict] = {}
        self.datasources: dict[str, dict] = {}
        self.dashboards: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []


def handler_for(state: GrafanaState) -> type[BaseHTTPRequestHandler]:
    class Grafana(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict:
            assert self.headers["Content-Type"].startswith("application/json")
            return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

        def _route(self, method: str) -> None:
            state.requests.append((method, self.path))
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                return self._reply(401, {"message": "Unauthorized"})
            parts = self.path.split("?")[0].strip("/").split("/")
            match method, parts:
                case "GET", ["api", "folders", uid]:
                    if uid in state.folders:
                        return self._reply(200, state.folders[uid])
                    return self._reply(404, {"message": "folder not found"})
                case "POST", ["api", "folders"]:
                    body = self._body()
                    if not body.get("title"):
                        return self._reply(400, {"message": "folder title cannot be empty"})
                    if body.get("uid") in state.folders:
                        return self._reply(409, {"message": "a folder with that uid exists"})
                    folder = {"id": len(state.folders) + 1, "uid": body["uid"],
                              "title": body["title"], "version": 1}
                    state.folders[body["uid"]] = folder
                    return self._reply(200, folder)
                case "GET", ["api", "datasources", "uid", uid]:
                    if uid in state.datasources:
                        return self._reply(200, state.datasources[uid])
                    return self._reply(404, {"message": "Data source not found"})
                case "POST", ["api", "datasources"]:
                    body = self._body()
                    missing = {"name", "type", "access"} - set(body)
                    if missing:
                        return self._reply(400, {"message": f"missing {sorted(missing)}"})
                    if any(d["name"] == body["name"] for d in state.datasources.values()):
                        return self._reply(409, {"message": "data source with the same name "
                                                 "already exists"})
                    state.datasources[body["uid"]] = body | {"id": len(state.datasources) + 1}
                    return self._reply(200, {"message": "Datasource added",
                                             "datasource": state.datasources[body["uid"]]})
                case "PUT", ["api", "datasources", "uid", uid]:
                    if uid not in state.datasources:
                        return self._reply(404, {"message": "Data source not found"})
                    state.datasources[uid] = self._body() | {"id": state.datasources[uid]["id"]}
                    return self._reply(200, {"message": "Datasource updated"})
                case "POST", ["api", "dashboards", "db"]:
                    body = self._body()
                    dashboard = body.get("dashboard") or {}
                    if not dashboard.get("title") or not dashboard.get("uid"):
                        return self._reply(400, {"message": "Dashboard title cannot be empty"})
                    if body.get("folderUid") not in state.folders:
                        return self._reply(400, {"message": "folder not found"})
                    uid = dashboard["uid"]
                    if uid in state.dashboards and not body.get("overwrite"):
                        return self._reply(412, {"status": "name-exists",
                                                 "message": "dashboard exists"})
                    version = state.dashboards.get(uid, {}).get("version", 0) + 1
                    state.dashboards[uid] = {"dashboard": dashboard, "version": version,
                                             "folderUid": body["folderUid"]}
                    return self._reply(200, {"id": len(state.dashboards), "uid": uid,
                                             "status": "success", "version": version,
                                             "url": f"/d/{uid}"})
            return self._reply(404, {"message": "Not found"})

        def do_GET(self) -> None:  # noqa: N802
            self._route("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._route("POST")

        def do_PUT(self) -> None:  # noqa: N802
            self._route("PUT")

    return Grafana


@pytest.fixture
def grafana() -> Iterator[tuple[str, GrafanaState]]:
    state = GrafanaState()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()
    server.server_close()


def push(url: str, token: str | None) -> object:
    env = {"GRAFANA_TOKEN": token} if token is not None else {"GRAFANA_TOKEN": ""}
    return CliRunner().invoke(cli, ["dashboards", "push", "--url", url,
                                    "--prometheus", "http://prometheus:9090"], env=env)


def test_push_provisions_folder_datasource_and_dashboards_idempotently(grafana):
    url, state = grafana
    first = push(url, TOKEN)
    assert first.exit_code == 0, first.output
    assert "folder: created" in first.output and "datasource: created" in first.output
    assert set(state.folders) == {FOLDER_UID}
    assert state.datasources[DATASOURCE_UID]["url"] == "http://prometheus:9090"
    assert state.datasources[DATASOURCE_UID]["type"] == "prometheus"
    assert set(state.dashboards) == {d.uid for d in DASHBOARDS}
    assert all(d["folderUid"] == FOLDER_UID for d in state.dashboards.values())

    second = push(url, TOKEN)
    assert second.exit_code == 0, second.output
    assert "folder: present" in second.output and "datasource: updated" in second.output
    assert len(state.folders) == 1 and len(state.datasources) == 1
    assert {d["version"] for d in state.dashboards.values()} == {2}  # saved over, not added
    assert TOKEN not in first.output + second.output


def test_push_needs_a_token_from_the_environment_and_never_prints_it(grafana):
    url, state = grafana
    missing = push(url, None)
    assert missing.exit_code == 2 and "GRAFANA_TOKEN" in missing.output
    assert not state.requests  # nothing sent without a token
    wrong = push(url, "wrong-token-value")
    assert wrong.exit_code == 1 and "error: provisioning" in wrong.output
    assert "wrong-token-value" not in wrong.output
    assert len(wrong.output.strip().splitlines()) == 1
