"""The least-request balancer (deploy/k8s/envoy) reaches the replicas the overlays run.

No Envoy binary here: the checks read envoy.yaml as it is shipped in its ConfigMap and hold
it to the rendering it balances for: the headless Service's DNS name and port, the
readiness route, the longest request the service accepts.
"""

from __future__ import annotations

from typing import Any

from tests.k8s.conftest import ENVOY, load_yaml, only, pod_env, render, serves_get, settings_for

CONFIG_KEY = "envoy.yaml"


def envoy_config() -> dict[str, Any]:
    config_map = only(render(ENVOY), "ConfigMap")
    config: dict[str, Any] = load_yaml(config_map["data"][CONFIG_KEY])
    return config


def backend_cluster() -> dict[str, Any]:
    clusters = envoy_config()["static_resources"]["clusters"]
    assert len(clusters) == 1
    cluster: dict[str, Any] = clusters[0]
    return cluster


def test_the_balancer_picks_the_replica_with_the_fewest_requests_in_flight() -> None:
    cluster = backend_cluster()
    assert cluster["lb_policy"] == "LEAST_REQUEST"
    assert cluster["type"] == "STRICT_DNS", "one endpoint per replica, from the headless Service"
    routes = envoy_config()["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    for host in routes["route_config"]["virtual_hosts"]:
        assert {route["route"]["cluster"] for route in host["routes"]} == {cluster["name"]}


def test_the_balancer_resolves_the_headless_service_of_the_server_pods() -> None:
    balancer = render(ENVOY)
    served = render("gpu")  # cpu and gpu run the same Deployment; gpu's is as good as cpu's
    pods = only(served, "Deployment", "ai-backend")["spec"]["template"]
    headless = only(balancer, "Service", "ai-backend-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= pods["metadata"]["labels"].items()
    assert headless["metadata"]["namespace"] == only(served, "Deployment")["metadata"]["namespace"]
    [locality] = backend_cluster()["load_assignment"]["endpoints"]
    [endpoint] = locality["lb_endpoints"]
    address = endpoint["endpoint"]["address"]["socket_address"]
    name, namespace = headless["metadata"]["name"], headless["metadata"]["namespace"]
    assert address["address"] == f"{name}.{namespace}.svc.cluster.local"
    settings = settings_for(pod_env(pods, served))
    assert address["port_value"] == settings.server.port
    assert {p["port"] for p in headless["spec"]["ports"]} == {settings.server.port}


def test_the_balancer_health_checks_readiness_and_waits_as_long_as_a_request_may() -> None:
    served = render("gpu")
    settings = settings_for(pod_env(only(served, "Deployment")["spec"]["template"], served))
    for check in backend_cluster()["health_checks"]:
        path = check["http_health_check"]["path"]
        assert path == "/readyz", "a draining replica answers 503 there and leaves at once"
        assert serves_get(settings, path)
    listener = envoy_config()["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    for host in manager["route_config"]["virtual_hosts"]:
        for route in host["routes"]:
            timeout_s = float(route["route"]["timeout"].removesuffix("s"))
            assert timeout_s >= settings.server.max_timeout_ms / 1000
    # a retry needs the whole body buffered: the largest JSON body the service accepts
    assert listener["per_connection_buffer_limit_bytes"] >= settings.server.max_body_bytes


def test_the_balancer_deployment_loads_the_config_it_ships() -> None:
    balancer = render(ENVOY)
    pod = only(balancer, "Deployment")["spec"]["template"]["spec"]
    config_map = only(balancer, "ConfigMap")
    [container] = pod["containers"]
    args = container["args"]
    config_path = args[args.index("--config-path") + 1]
    mount_dir, _, key = config_path.rpartition("/")
    assert key == CONFIG_KEY
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts[mount_dir]]["configMap"]["name"] == config_map["metadata"]["name"]
    listen = envoy_config()["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    assert listen in {p["containerPort"] for p in container["ports"]}
