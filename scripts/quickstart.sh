#!/usr/bin/env bash
# Installs everything, starts an embedded S3 server (SeaweedFS) on 127.0.0.1, fills a bucket
# with sample data and mounts it at ./demo/mnt. `scripts/quickstart.sh stop` tears it down.
set -euo pipefail
cd "$(dirname "$0")/.."
DEMO="$PWD/demo"
export AWS_ACCESS_KEY_ID=demo AWS_SECRET_ACCESS_KEY=demo-secret AWS_DEFAULT_REGION=us-east-1
ENDPOINT=http://127.0.0.1:8333

if [ "${1:-}" = "stop" ]; then
    if mountpoint -q "$DEMO/mnt" 2>/dev/null; then .venv/bin/objcache umount "$DEMO/mnt"; fi
    if [ -f "$DEMO/weed.pid" ]; then kill "$(cat "$DEMO/weed.pid")" 2>/dev/null || true; rm -f "$DEMO/weed.pid"; fi
    echo "stopped"
    exit 0
fi

./scripts/setup.sh
mkdir -p "$DEMO/weed" "$DEMO/mnt"
if ! { [ -f "$DEMO/weed.pid" ] && kill -0 "$(cat "$DEMO/weed.pid")" 2>/dev/null; }; then
    cat > "$DEMO/s3.json" <<JSON
{"identities":[{"name":"demo","credentials":[{"accessKey":"demo","secretKey":"demo-secret"}],
 "actions":["Admin","Read","Write","List","Tagging"]}]}
JSON
    setsid .venv/bin/weed mini -dir="$DEMO/weed" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
        -s3.config="$DEMO/s3.json" -s3.port.iceberg=0 -s3.port.lance=0 \
        > "$DEMO/weed.log" 2>&1 < /dev/null &
    echo $! > "$DEMO/weed.pid"
fi
.venv/bin/python - <<'PY'
import os, time, boto3
from botocore.config import Config
s3 = boto3.client("s3", endpoint_url="http://127.0.0.1:8333",
                  config=Config(s3={"addressing_style": "path"}))
for _ in range(150):
    try:
        s3.create_bucket(Bucket="demo") if "demo" not in [
            b["Name"] for b in s3.list_buckets()["Buckets"]] else None
        s3.put_object(Bucket="demo", Key="README.txt",
                      Body=b"Hello from objcache: this file lives in the bucket 'demo'.\n")
        break
    except Exception:
        time.sleep(0.2)
else:
    raise SystemExit("quickstart: SeaweedFS did not start; see demo/weed.log")
for i in range(20):
    s3.put_object(Bucket="demo", Key=f"dataset/shard-{i:03d}.bin", Body=os.urandom(256 << 10))
s3.put_object(Bucket="demo", Key="models/weights.bin", Body=os.urandom(64 << 20))
PY
if ! mountpoint -q "$DEMO/mnt"; then
    .venv/bin/objcache mount s3://demo "$DEMO/mnt" --endpoint-url "$ENDPOINT" \
        --cache-dir "$DEMO/cache" --cache-size 2G
fi
ls -l "$DEMO/mnt"
.venv/bin/objcache status "$DEMO/mnt"
echo
echo "Mounted s3://demo at $DEMO/mnt (S3: $ENDPOINT, key demo / demo-secret)."
echo "Stop with: scripts/quickstart.sh stop"
