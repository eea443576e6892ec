"""The S3 fault proxy in front of a real S3 endpoint (moto): it forwards, refuses writes during
an outage while reads go on, and holds then drops or forwards a commit."""
from __future__ import annotations

import threading

import pytest

from chaos.proxy import FaultProxy

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def s3(s3_env):
    import boto3
    from botocore.config import Config
    proxy = FaultProxy(s3_env)
    client = boto3.client("s3", endpoint_url=proxy.endpoint,
                          config=Config(retries={"total_max_attempts": 1, "mode": "standard"}))
    direct = boto3.client("s3", endpoint_url=s3_env)
    direct.create_bucket(Bucket="proxied")
    try:
        yield proxy, client, direct
    finally:
        proxy.close()


def exists(client, key: str) -> bool:
    return client.list_objects_v2(Bucket="proxied", Prefix=key).get("KeyCount", 0) > 0


def test_an_outage_refuses_writes_with_503_and_reads_go_on(s3):
    from botocore.exceptions import ClientError
    proxy, client, _ = s3
    client.put_object(Bucket="proxied", Key="a", Body=b"x" * 100_000)
    proxy.refuse(60)
    with pytest.raises(ClientError) as refused:
        client.put_object(Bucket="proxied", Key="b", Body=b"y")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert client.get_object(Bucket="proxied", Key="a")["Body"].read() == b"x" * 100_000
    proxy.stop_refusing()
    client.put_object(Bucket="proxied", Key="b", Body=b"y")
    counts = proxy.snapshot()
    assert counts["refused"] == 1 and counts["forwarded"] >= 3


@pytest.mark.parametrize("drop", [True, False])
def test_a_held_commit_is_dropped_or_forwarded_late(s3, drop):
    proxy, client, direct = s3
    proxy.hold("/COMMITTED")
    outcome = {}

    def commit():
        try:
            client.put_object(Bucket="proxied", Key="run/step_00000010/COMMITTED", Body=b"{}")
            outcome["ok"] = True
        except Exception as e:   # noqa: BLE001 - the dropped PUT's error is the expected outcome
            outcome["error"] = e

    writer = threading.Thread(target=commit)
    writer.start()
    assert proxy.wait_held(10)
    client.put_object(Bucket="proxied", Key="run/step_00000010/shard", Body=b"s")   # others pass
    assert not exists(direct, "run/step_00000010/COMMITTED")
    proxy.release(drop=drop)
    writer.join(timeout=20)
    assert exists(direct, "run/step_00000010/COMMITTED") is (not drop)
    assert ("error" in outcome) is drop


def test_a_stall_holds_reads_and_writes_until_it_ends():
    """Against a stand-in upstream that is never reached while the stall lasts: requests wait in
    the proxy (counted as stalled), and go through once the stall is ended."""
    import http.client
    import http.server

    class Upstream(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    proxy = FaultProxy(f"http://127.0.0.1:{upstream.server_address[1]}")
    answers: list[int] = []
    try:
        proxy.stall(3600)

        def get():
            conn = http.client.HTTPConnection(proxy.endpoint.split("//")[1], timeout=30)
            conn.request("GET", "/bucket/key")
            answers.append(conn.getresponse().status)
            conn.close()
        thread = threading.Thread(target=get)
        thread.start()
        thread.join(timeout=1.0)
        assert thread.is_alive() and answers == [] and proxy.snapshot()["stalled"] == 1
        proxy.stop_stalling()
        thread.join(timeout=10)
        assert answers == [200] and proxy.snapshot()["forwarded"] == 1
    finally:
        proxy.close()
        upstream.shutdown()
        upstream.server_close()
