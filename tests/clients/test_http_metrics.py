"""`/metrics` on `llmd http`: Prometheus's text format, read back with prometheus_client's own parser;
the front's counters and histograms move with requests, the daemon's figures come from its stats."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from daemon_fixtures import daemon_settings, running_daemon
from http_fixtures import call, running_front
from llmd.clients.http_front import FrontConfig
from llmd.clients.http_metrics import daemon_families

# longer than two blocks of 16 tokens under the tiny model's byte-level tokenizer: a repeat hits the cache
REPEATED = "def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[0]\n"


@pytest.fixture(scope="module")
def front(tiny_model_dir, tmp_path_factory):
    with running_daemon(daemon_settings(tiny_model_dir, tmp_path_factory.mktemp("metrics"))) as daemon:
        with running_front(FrontConfig(socket=daemon.settings.socket, port=0)) as url:
            yield url


def scrape(url: str) -> dict:
    """``/metrics`` as {(sample name, sorted labels): value}, parsed by prometheus_client."""
    status, headers, body = call(url + "/metrics", method="GET")
    assert status == 200 and headers["Content-Type"].startswith("text/plain"), (status, headers)
    return samples(body.decode())


def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.heavy
def test_counters_and_histograms_move_with_requests(front):
    before = scrape(front)
    n = 3
    for i in range(n):
        status, _, _ = call(front + "/v1/completions", {"prompt": f"x = {i}", "max_tokens": 4})
        assert status == 200
    assert call(front + "/v1/completions", {"prompt": "a", "n": 2})[0] == 400
    after = scrape(front)
    ok = dict(endpoint="/v1/completions", code="200")
    assert value(after, "llmd_http_requests_total", **ok) - value(before, "llmd_http_requests_total", **ok) == n
    bad = dict(endpoint="/v1/completions", code="400")
    assert value(after, "llmd_http_requests_total", **bad) - value(before, "llmd_http_requests_total", **bad) == 1
    for name in ("llmd_time_to_first_token_seconds_count", "llmd_inter_token_seconds_count"):
        assert value(after, name) - value(before, name) == n, name
    assert (value(after, "llmd_http_request_duration_seconds_count", endpoint="/v1/completions")
            - value(before, "llmd_http_request_duration_seconds_count", endpoint="/v1/completions")) == n + 1
    assert value(after, "llmd_generation_tokens_total") - value(before, "llmd_generation_tokens_total") == 4 * n
    assert value(after, "llmd_requests_finished_total", reason="length") >= n


@pytest.mark.heavy
def test_a_repeated_prompt_moves_the_prefix_hits(front):
    call(front + "/v1/completions", {"prompt": REPEATED, "max_tokens": 2})
    before = scrape(front)
    assert call(front + "/v1/completions", {"prompt": REPEATED, "max_tokens": 2})[0] == 200
    after = scrape(front)
    assert value(after, "llmd_prefix_tokens_hit_total") - value(before, "llmd_prefix_tokens_hit_total") >= 16
    assert 0 < value(after, "llmd_prefix_hit_ratio") <= 1


@pytest.mark.heavy
def test_daemon_gauges_are_there(front):
    m = scrape(front)
    assert value(m, "llmd_up") == 1 and value(m, "llmd_ready") == 1
    for name in ("llmd_requests_waiting", "llmd_requests_running", "llmd_kv_usage_ratio", "llmd_requests_in_flight"):
        assert (name, ()) in m, name
    assert value(m, "llmd_kv_blocks", state="total") > 0
    assert ("llmd_spec_proposed_tokens_total", ()) in m and ("llmd_spec_accepted_tokens_total", ()) in m


@pytest.mark.heavy
def test_a_streamed_and_an_ollama_answer_count_too(front):
    before = scrape(front)
    assert call(front + "/v1/completions", {"prompt": "y", "max_tokens": 3, "stream": True})[0] == 200
    assert call(front + "/api/generate", {"model": "m", "prompt": "y", "stream": False,
                                          "options": {"num_predict": 3}})[0] == 200
    after = scrape(front)
    name = "llmd_time_to_first_token_seconds_count"
    assert value(after, name) - value(before, name) == 2
    ollama = dict(endpoint="/api/generate", code="200")
    assert value(after, "llmd_http_requests_total", **ollama) - value(before, "llmd_http_requests_total", **ollama) == 1


class OneReply:
    def __init__(self, stats: dict):
        self.stats = stats

    def collect(self):
        return daemon_families(self.stats)


def exposed(stats: dict) -> dict:
    """The samples of one daemon ``stats`` reply, through a registry and the text format."""
    registry = CollectorRegistry()
    registry.register(OneReply(stats))
    return samples(generate_latest(registry).decode())


def test_kv_disk_figures_are_exposed_when_the_daemon_reports_them():
    stats = {"state": "ready", "in_flight": 0, "finished": {"stop": 2}, "refused_busy": 0,
             "engine": {"kv_usage": 0.5, "kv_disk_on": True, "kv_disk_hits": 3, "kv_disk_blocks_read": 7,
                        "kv_disk_bytes": 4096, "kv_disk_blocks_restored": 7, "kv_disk_parked": 0}}
    m = exposed(stats)
    assert value(m, "llmd_kv_disk_hits_total") == 3 and value(m, "llmd_kv_disk_blocks_read_total") == 7
    assert value(m, "llmd_kv_disk_bytes") == 4096 and value(m, "llmd_kv_disk_on") == 1
    assert value(m, "llmd_kv_disk_blocks_restored_total") == 7
    assert value(m, "llmd_requests_finished_total", reason="stop") == 2
    without = exposed({**stats, "engine": {"kv_usage": 0.5}})
    assert not any(name.startswith("llmd_kv_disk") for name, _ in without)


@pytest.mark.heavy
def test_metrics_answer_without_a_daemon(tmp_path):
    with running_front(FrontConfig(socket=str(tmp_path / "none.sock"), port=0)) as url:
        m = scrape(url)
        assert value(m, "llmd_up") == 0
