"""The app deployed on Ray Serve under a ``route_prefix``, through Serve's HTTP proxy on a loopback port.

Serve's proxy hands a replica the request's whole path (``/tight/admin/policy``) and the prefix
as ``root_path``. What the app matches before FastAPI's router must take the prefix off as the
router does: here the admin gate, whose token check comes before any body is read. One local
cluster for the module (about 10 s to start), one replica; only 127.0.0.1 is spoken to.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import MODELS_DIR, REPO_ROOT, free_ports, sample_png

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.ray

HOST = "127.0.0.1"
MOUNT = "/tight"
TOKEN = "route-prefix-admin-token-0123456789"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from app.ray_app import build

    token_file = tmp_path_factory.mktemp("secrets") / "admin-token"
    token_file.write_text(TOKEN)
    args = {
        "config_file": str(REPO_ROOT / "config" / "default.toml"),
        "model.repository": str(MODELS_DIR),
        "model.device": "cpu",
        "model.intra_op_threads": "1",
        "num_cpus": "0.5",
        "num_replicas": "1",
        "logging.access_log": "false",
        "logging.level": "WARNING",
        "admin.enabled": "true",
        "admin.token_file": str(Path(token_file).absolute()),
    }
    (http_port,) = free_ports(1, HOST)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": HOST, "port": http_port})
        serve.run(build(args), name="prefixed", route_prefix=MOUNT)
        yield f"http://{HOST}:{http_port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_under_a_route_prefix_the_admin_token_is_checked_before_the_body_is_read(url: str) -> None:
    json_type = {"Content-Type": "application/json"}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.get(f"{MOUNT}/readyz").json() == {"status": "ready"}
        predicted = client.post(f"{MOUNT}/predict", content=sample_png(7), headers={"Content-Type": "image/png"})
        assert predicted.status_code == 200 and predicted.json()["predictions"][0]["label"] == "7"
        policy = f"{MOUNT}/admin/policy"
        malformed = client.put(policy, content=b"{not json", headers=json_type)
        assert malformed.status_code == 401, "refused for its token, not parsed first"
        big = client.put(policy, content=b" " * (1 << 20), headers={**auth, **json_type})
        assert big.status_code == 413 and big.json()["code"] == "body_too_large"
        assert client.put(policy, headers=auth, json={"normal": {"max_batch": 4}}).is_success
