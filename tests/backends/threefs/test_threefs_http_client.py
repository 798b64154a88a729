"""The metadata client against a service that answers nonsense (issue 14, item 9).

A fake HTTP service in this file answers each method with what a test scripts: negative or huge
numbers, wrong types, missing or unknown fields, malformed JSON, the wrong number of results,
unknown statuses, slots outside the namespace. Every such answer must be a typed
:class:`~hicache_storage.errors.BackendError` (:class:`MalformedAnswer`) from the client, and a
counted miss through the backend's default layers, never a raw exception or a wrong hit. Long
batches are split into calls the real service accepts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec
import pytest

from hicache_storage import LayerConfig, create_backend
from hicache_storage.backends.threefs.metadata import Geometry
from hicache_storage.backends.threefs.metadata_http import (
    MAX_BODY_BYTES,
    MAX_KEYS_PER_CALL,
    HttpMetadata,
    MalformedAnswer,
)
from hicache_storage.backends.threefs.provision import metadata_service
from hicache_storage.errors import BackendError, BackendUnavailableError

GEO = Geometry(slot_bytes=4096, slots_per_file=8, file_count=2)  # 16 slots, 64 KiB
Answer = tuple[int, bytes] | Callable[[dict[str, Any]], tuple[int, bytes]]
DECLARE_HUGE = b"declare a huge length"


class FakeService:
    """Answers ``POST /v1/<method>`` with ``answers[method]`` (bytes, or a function of the body)."""

    def __init__(self) -> None:
        self.answers: dict[str, Answer] = {"open": (200, b'"epoch-1"')}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = msgspec.json.decode(self.rfile.read(int(self.headers["Content-Length"])))
                method = self.path.removeprefix("/v1/")
                fake.calls.append((method, body))
                answer = fake.answers.get(method, (404, b'"no"'))
                status, data = answer(body) if callable(answer) else answer
                self.send_response(status)
                if data == DECLARE_HUGE:  # and never send it
                    self.send_header("Content-Length", str(1 << 40))
                    self.end_headers()
                    return
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake() -> Iterator[FakeService]:
    service = FakeService()
    yield service
    service.close()


@pytest.fixture
def meta(fake: FakeService) -> Iterator[HttpMetadata]:
    client = HttpMetadata(fake.url, timeout_s=5.0)
    assert client.open("ns", GEO) == "epoch-1"
    yield client
    client.close()


def ok(value: Any) -> tuple[int, bytes]:
    return 200, msgspec.json.encode(value)


# Each case: the method called, what the fake answers, and how the client calls it.
CALLS: dict[str, Callable[[HttpMetadata], Any]] = {
    "lookup": lambda m: m.lookup("ns", ["a"]),
    "confirm": lambda m: m.confirm("ns", "epoch-1", [("a", 1)]),
    "exists": lambda m: m.exists("ns", ["a"]),
    "reserve": lambda m: m.reserve("ns", GEO, [("a", 5000)]),  # two slots
    "commit": lambda m: m.commit("ns", "epoch-1", [1]),
    "delete": lambda m: m.delete("ns", ["a"]),
    "clear": lambda m: m.clear("ns"),
    "states": lambda m: m.states("ns", ["a"]),
    "stats": lambda m: m.stats("ns"),
    "open": lambda m: m.open("other", GEO),
}

NONSENSE: list[tuple[str, str, tuple[int, bytes]]] = [
    # lookup: numbers out of range, slots outside the namespace or too few, shapes
    ("lookup", "negative length", ok({"epoch": "e", "locations": [[1, -1, [[0, 1]]]]})),
    ("lookup", "huge length", ok({"epoch": "e", "locations": [[1, 1 << 70, [[0, 1]]]]})),
    ("lookup", "length over capacity", ok({"epoch": "e", "locations": [[1, 1 << 20, [[0, 16]]]]})),
    ("lookup", "negative id", ok({"epoch": "e", "locations": [[-5, 10, [[0, 1]]]]})),
    ("lookup", "negative slot", ok({"epoch": "e", "locations": [[1, 10, [[-1, 1]]]]})),
    ("lookup", "empty run", ok({"epoch": "e", "locations": [[1, 10, [[0, 0]]]]})),
    ("lookup", "slot outside", ok({"epoch": "e", "locations": [[1, 10, [[16, 1]]]]})),
    ("lookup", "huge slot", ok({"epoch": "e", "locations": [[1, 10, [[1 << 62, 1]]]]})),
    ("lookup", "too few slots", ok({"epoch": "e", "locations": [[1, 9000, [[0, 2]]]]})),
    ("lookup", "two for one key", ok({"epoch": "e", "locations": [None, None]})),
    ("lookup", "none for one key", ok({"epoch": "e", "locations": []})),
    ("lookup", "missing epoch", ok({"locations": [None]})),
    ("lookup", "empty epoch", ok({"epoch": "", "locations": [None]})),
    ("lookup", "epoch a number", ok({"epoch": 7, "locations": [None]})),
    ("lookup", "unknown field", ok({"epoch": "e", "locations": [None], "x": 1})),
    ("lookup", "extra location field", ok({"epoch": "e", "locations": [[1, 10, [[0, 1]], 9]]})),
    ("lookup", "length a string", ok({"epoch": "e", "locations": [[1, "10", [[0, 1]]]]})),
    ("lookup", "length a float", ok({"epoch": "e", "locations": [[1, 10.5, [[0, 1]]]]})),
    ("lookup", "malformed JSON", (200, b'{"epoch": "e", "locations": [')),
    ("lookup", "not JSON", (200, b"<html>oops</html>")),
    ("lookup", "a list", ok([None])),
    # the others
    ("confirm", "two for one pair", ok([True, True])),
    ("confirm", "not booleans", ok([1])),
    ("exists", "negative", ok(-1)),
    ("exists", "more than asked", ok(2)),
    ("exists", "a boolean", ok(True)),
    ("exists", "a string", ok("1")),
    ("reserve", "unknown status", ok({"epoch": "e", "lease_s": 1.0, "grants": [["maybe", 1, []]]})),
    ("reserve", "no grant", ok({"epoch": "e", "lease_s": 1.0, "grants": []})),
    ("reserve", "zero lease", ok({"epoch": "e", "lease_s": 0, "grants": [["busy", 0, []]]})),
    ("reserve", "negative lease", ok({"epoch": "e", "lease_s": -3, "grants": [["busy", 0, []]]})),
    ("reserve", "reserved, no slots", ok({"epoch": "e", "lease_s": 1.0, "grants": [["reserved"]]})),
    (
        "reserve",
        "reserved outside",
        ok({"epoch": "e", "lease_s": 1.0, "grants": [["reserved", 1, [[15, 2]]]]}),
    ),
    (
        "reserve",
        "reserved too few",
        ok({"epoch": "e", "lease_s": 1.0, "grants": [["reserved", 1, [[0, 1]]]]}),
    ),
    (
        "reserve",
        "negative id",
        ok({"epoch": "e", "lease_s": 1.0, "grants": [["reserved", -1, [[0, 2]]]]}),
    ),
    ("commit", "none for one id", ok([])),
    ("delete", "a dict", ok({"a": True})),
    ("clear", "negative", ok(-4)),
    ("states", "unknown state", ok(["zombie"])),
    ("states", "two for one key", ok(["absent", "absent"])),
    ("stats", "a list", ok([1, 2])),
    ("open", "epoch a number", ok(5)),
    ("open", "empty epoch", ok("")),
]


@pytest.mark.parametrize(
    ("method", "answer"),
    [pytest.param(method, answer, id=f"{method}-{what}") for method, what, answer in NONSENSE],
)
def test_nonsense_answers_are_typed_errors(
    fake: FakeService, meta: HttpMetadata, method: str, answer: tuple[int, bytes]
) -> None:
    fake.answers[method] = answer
    with pytest.raises(MalformedAnswer) as raised:
        CALLS[method](meta)
    assert isinstance(raised.value, BackendError) and not raised.value.retryable


def test_sensible_answers_pass(fake: FakeService, meta: HttpMetadata) -> None:
    fake.answers["lookup"] = ok({"epoch": "e", "locations": [[3, 5000, [[14, 2]]]]})
    fake.answers["reserve"] = ok(
        {"epoch": "e", "lease_s": 2.5, "grants": [["reserved", 4, [[0, 2]]]]}
    )
    fake.answers["exists"] = ok(1)
    location = meta.lookup("ns", ["a"]).locations[0]
    assert location is not None and (location.id, location.length) == (3, 5000)
    assert location.extents == [(14, 2)]
    grant = meta.reserve("ns", GEO, [("a", 5000)]).grants[0]
    assert (grant.status, grant.id, grant.extents) == ("reserved", 4, [(0, 2)])
    assert meta.exists("ns", ["a"]) == 1


def test_an_oversized_answer_is_refused_unread(fake: FakeService, meta: HttpMetadata) -> None:
    fake.answers["exists"] = (200, DECLARE_HUGE)
    with pytest.raises(MalformedAnswer, match="answer of"):
        meta.exists("ns", ["a"])


# -- through the backend: a counted miss, never a raw exception or a wrong hit ------------------


@pytest.mark.parametrize(
    "lookup",
    [
        ok({"epoch": "epoch-1", "locations": [[1, -1, [[0, 1]]]]}),  # raised ValueError before
        ok({"epoch": "epoch-1", "locations": [[1, 100, [[1 << 40, 1]]]]}),
        ok({"epoch": "epoch-1", "locations": [None, None, None]}),
        ok({"epoch": "epoch-1", "locations": [[1, 1 << 50, [[0, 1]]]]}),
    ],
    ids=["negative-length", "slot-outside", "wrong-count", "huge-length"],
)
def test_backend_turns_nonsense_into_a_counted_miss(
    fake: FakeService, tmp_path: Path, lookup: tuple[int, bytes]
) -> None:
    fake.answers["lookup"] = lookup
    fake.answers["confirm"] = lambda body: ok([True] * len(body["pairs"]))
    backend = create_backend(
        "3fs",
        {
            "path": str(tmp_path),
            "file_size": 64 << 10,
            "file_count": 2,
            "slot_bytes": 4096,
            "metadata_url": fake.url,
            "timeout_s": 5.0,
        },
        layers=LayerConfig(health=None),  # each nonsense answer reaches the backend
    )
    try:
        assert backend.get("a") is None
        assert backend.batch_get(["a", "b"], [bytearray(100), bytearray(100)]) == [False, False]
        degraded = backend.stats()["degraded"]
        assert degraded["total"] == 2
        assert set(degraded["errors"]["get"]) == {"MalformedAnswer"}
    finally:
        backend.close()


# -- batches longer than one call ---------------------------------------------------------------


def test_long_batches_are_split_and_joined(fake: FakeService, meta: HttpMetadata) -> None:
    fake.answers["lookup"] = lambda body: ok(
        {"epoch": "e", "locations": [None] * len(body["keys"])}
    )
    fake.answers["states"] = lambda body: ok(["absent"] * len(body["keys"]))
    exists_answers = iter([MAX_KEYS_PER_CALL, 5])
    fake.answers["exists"] = lambda body: ok(next(exists_answers))
    keys = [f"key-{i}" for i in range(2 * MAX_KEYS_PER_CALL + 10)]
    fake.calls.clear()
    assert meta.lookup("ns", keys).locations == [None] * len(keys)
    assert [len(body["keys"]) for _, body in fake.calls] == [MAX_KEYS_PER_CALL] * 2 + [10]
    assert len(meta.states("ns", keys)) == len(keys)
    fake.calls.clear()
    assert meta.exists("ns", keys) == MAX_KEYS_PER_CALL + 5  # stops at the first short run
    assert len(fake.calls) == 2


def test_a_batch_answered_by_two_epochs_is_refused(fake: FakeService, meta: HttpMetadata) -> None:
    epochs = iter(["e1", "e2", "e3"])
    fake.answers["lookup"] = lambda body: ok(
        {"epoch": next(epochs), "locations": [None] * len(body["keys"])}
    )
    with pytest.raises(BackendUnavailableError, match="restarted"):
        meta.lookup("ns", [f"k{i}" for i in range(MAX_KEYS_PER_CALL + 1)])


def test_a_body_over_the_limit_is_split_by_size(fake: FakeService, meta: HttpMetadata) -> None:
    fake.answers["delete"] = lambda body: ok([False] * len(body["keys"]))
    keys = ["k" * 1000 + str(i) for i in range(MAX_BODY_BYTES // 1000 * 2)]  # not valid keys
    assert meta.delete("ns", keys) == [False] * len(keys)
    assert len(fake.calls) > 2
    assert all(len(msgspec.json.encode(body)) <= MAX_BODY_BYTES for _, body in fake.calls)


def test_the_real_service_takes_a_batch_of_many_calls(tmp_path: Path) -> None:
    # A lease long enough for a slow, loaded machine to commit thousands of reservations: this
    # checks batch splitting, and a lapsed lease would refuse the commit (the fencing tests' job).
    service = metadata_service(tmp_path, lease_s=30.0, timeout_s=5.0)
    with service:
        meta = HttpMetadata(service.options["metadata_url"], timeout_s=10.0)
        try:
            geometry = Geometry(slot_bytes=64, slots_per_file=20_000, file_count=1)
            meta.open("big", geometry)
            keys = [f"{i:064x}" + "_tp0of1_" + "x" * 120 for i in range(MAX_KEYS_PER_CALL + 500)]
            assert max(len(key) for key in keys) <= 200
            reservation = meta.reserve("big", geometry, [(key, 64) for key in keys])
            assert {grant.status for grant in reservation.grants} == {"reserved"}
            ids = [grant.id for grant in reservation.grants]
            assert meta.commit("big", reservation.epoch, ids) == [True] * len(keys)
            assert meta.exists("big", keys) == len(keys)
            found = meta.lookup("big", keys)
            assert all(location is not None for location in found.locations)
        finally:
            meta.close()
