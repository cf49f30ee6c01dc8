#!/usr/bin/env bash
# The README's first command on what it installs alone: a new virtual environment without
# system site packages, activated, then `make run` (runtime dependencies only: no test
# extras), which must serve the embedded default and answer one chat request over HTTP.
# A run-time import that no declared dependency provides fails here, as it would for a user.
#
#   bash scripts/check_fresh_install.sh            # from the repository root
#   FRESH_INSTALL_TIMEOUT=900 bash scripts/...      # seconds for install + start (default 900)
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
timeout=${FRESH_INSTALL_TIMEOUT:-900}
work=$(mktemp -d)
log="$work/run.log"
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
server=""

cleanup() {
    if [[ -n "$server" ]] && kill -0 "$server" 2>/dev/null; then
        kill -TERM -- "-$server" 2>/dev/null || true     # make and the server it started
        for _ in $(seq 30); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$server" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

echo "fresh install: new venv in $work/venv, then 'make run' on port $port"
"$python" -m venv "$work/venv"                 # no --system-site-packages: nothing leaks in
# Its own process group, so that cleanup stops make and the server together.
setsid bash -c ". '$work/venv/bin/activate' && exec make run PORT=$port" >"$log" 2>&1 &
server=$!

deadline=$((SECONDS + timeout))
until "$python" - "$port" <<'EOF' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=5).read()
EOF
do
    if ! kill -0 "$server" 2>/dev/null; then
        echo "FAILED: 'make run' exited before serving; its output:"; tail -n 60 "$log"; exit 1
    fi
    if (( SECONDS > deadline )); then
        echo "FAILED: no /health answer within ${timeout}s; the output:"; tail -n 60 "$log"; exit 1
    fi
    sleep 2
done

"$python" - "$port" <<'EOF' || { echo "the server's output:"; tail -n 60 "$log"; exit 1; }
import json, sys, urllib.request

body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16, "temperature": 0}
request = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(request, timeout=300))
content = reply["choices"][0]["message"]["content"]
if not content.strip():
    sys.exit(f"FAILED: an empty answer: {reply}")
print(f"fresh install: 'make run' answered a chat request: {content!r}")
EOF
