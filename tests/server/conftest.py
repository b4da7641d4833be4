"""A live reward server (uvicorn in a thread, real sockets) on a free loopback port."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
import uvicorn

from redteam_grpo.core.config import RewardConfig
from redteam_grpo.core.scoring.backend import build_local_scoring
from redteam_grpo.server.app import create_app
from redteam_grpo.server.settings import ServerSettings


class LiveServer:
    def __init__(self, app) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the reward server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        while httpx.get(self.url + "/ready").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the reward server never became ready")
            time.sleep(0.05)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="session")
def live_reward_server(embedded_assets):
    backend = build_local_scoring(RewardConfig(), torch.device("cpu"))
    with LiveServer(create_app(ServerSettings(max_texts=64, max_chars=2000), lambda: backend)) as url:
        yield url
