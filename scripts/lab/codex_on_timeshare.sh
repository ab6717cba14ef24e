#!/usr/bin/env bash
# Codex CLI on Timeshare's /v1/responses, end to end (issue 42's "Real clients", a lab run on CPU):
# `timeshare serve` from this checkout's venv with the demo models in a scratch TIMESHARE_HOME,
# a logging reverse proxy in front of it (scripts/lab/request_log_proxy.py: every request body and
# answer in $LAB/requests), a scratch CODEX_HOME whose config.toml names Timeshare as a custom
# provider (wire_api = "responses"), and one non-interactive `codex exec` (read-only sandbox, no
# approvals) that asks the model to read a small file.
#
#   scripts/lab/codex_on_timeshare.sh [LAB_DIR]        (default: a new /tmp/codex-lab-XXXX)
#
# MODEL=gemma3-270m-calls (a lab chat template, below) makes the tiny model call exec_command, so
# the run shows the tool round trip too.
#
# Environment: CODEX (the codex binary; default `codex` on PATH, else
# /work/codex/node_modules/.bin/codex, installed with
# `npm install --prefix /work/codex @openai/codex@0.171.0`), MODEL (default gemma3-270m: its
# 32k context holds Codex's ~10k-token prompt; SmolLM2's 8k does too, barely), N_CTX (default
# 32768), MAX_TOKENS (default 256: the models' answer cap; Codex sends no max_output_tokens, and
# a tiny model that rambles would write until its context is full), PROMPT (what codex exec is asked). The demo model is tiny: whether it reads the file is up
# to it; what this shows is that every request Codex sends is answered (see $LAB/requests).
set -euo pipefail

here=$(cd "$(dirname "$0")/../.." && pwd)
lab=${1:-$(mktemp -d /tmp/codex-lab-XXXX)}
model=${MODEL:-gemma3-270m}
n_ctx=${N_CTX:-32768}
max_tokens=${MAX_TOKENS:-256}
codex=${CODEX:-$(command -v codex || echo /work/codex/node_modules/.bin/codex)}
prompt=${PROMPT:-"Read the file notes.txt in the current directory and tell me the secret word it contains."}
py="$here/.venv/bin/python"
key="codex-lab-key"

mkdir -p "$lab/home" "$lab/codex-home" "$lab/work"
echo "lab: $lab (codex: $("$codex" --version))"

read -r gemma smol < <("$py" -c "from timeshare.core.config import demo; print(demo.gemma3_path(), demo.smollm2_path())")
example='<start_of_turn>user
Show me what a.txt says.<end_of_turn>
<start_of_turn>model
{"name": "exec_command", "arguments": {"cmd": "cat a.txt"}}<end_of_turn>
'
calls_template="{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}<start_of_turn>model
{{ m.content }}<end_of_turn>
{% else %}{% if m.role == 'user' and loop.last %}$example{% endif %}<start_of_turn>user
{{ m.content }}<end_of_turn>
{% endif %}{% endfor %}{% if add_generation_prompt %}<start_of_turn>model
{% endif %}"
cat >"$lab/timeshare.toml" <<EOF
[api]
key = "$key"

[[models]]
id = "gemma3-270m"
path = "$gemma"
n_ctx = $n_ctx
max_tokens = $max_tokens

[[models]]
id = "smollm2-135m-instruct"
path = "$smol"
n_ctx = 8192
max_tokens = $max_tokens

# Gemma-3-270M with a lab chat template that shows it one example exchange (a user asks for a
# file, the answer is a call of exec_command in the generic tool format) before each user turn:
# the tiny model then mostly calls the tool, so Codex runs it and sends its output back (the
# round trip's requests). Not a model to use: a way to make the demo model call.
[[models]]
id = "gemma3-270m-calls"
path = "$gemma"
n_ctx = $n_ctx
max_tokens = $max_tokens
chat_template = '''$calls_template'''
EOF

pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

TIMESHARE_HOME="$lab/home" "$py" -m timeshare --config "$lab/timeshare.toml" serve --port 0 \
    >"$lab/serve.log" 2>&1 &
pids+=($!)
serve_pid=$!
url=""
for _ in $(seq 600); do
    if [ -s "$lab/home/run/api.json" ]; then
        url=$("$py" -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['url'] if r['pid']==$serve_pid else '')" "$lab/home/run/api.json")
        [ -n "$url" ] && break
    fi
    sleep 0.2
done
[ -n "$url" ] || { echo "timeshare serve did not start:"; tail -20 "$lab/serve.log"; exit 1; }
for _ in $(seq 600); do
    grep -q "^ready: " "$lab/serve.log" && break
    sleep 0.5
done
echo "timeshare serve: $url"

"$py" "$here/scripts/lab/request_log_proxy.py" --upstream "$url" --out "$lab/requests" \
    >"$lab/proxy.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$lab/requests/address" ] && break; sleep 0.1; done
proxy=$(cat "$lab/requests/address")
echo "logging proxy: $proxy -> $url (requests in $lab/requests)"

cat >"$lab/codex-home/config.toml" <<EOF
model_provider = "timeshare"
model = "$model"
# Timeshare runs no hosted tools: without this Codex offers the model OpenAI's web_search,
# which Timeshare refuses (400 naming tools[i].type)
web_search = "disabled"

[model_providers.timeshare]
name = "Timeshare"
base_url = "$proxy/v1"
wire_api = "responses"
env_key = "TIMESHARE_API_KEY"
EOF

printf 'The secret word is PELICAN.\nThis file has three lines.\nThe last line is this one.\n' \
    >"$lab/work/notes.txt"

set +e
(cd "$lab/work" && CODEX_HOME="$lab/codex-home" TIMESHARE_API_KEY="$key" timeout 900 \
    "$codex" exec --skip-git-repo-check --ephemeral -s read-only --color never --json \
    -o "$lab/last-message.txt" "$prompt" </dev/null >"$lab/codex-events.jsonl" 2>"$lab/codex-stderr.txt")
rc=$?
set -e
echo "codex exec exit status: $rc"
echo "requests Codex sent (status of each answer):"
for f in "$lab"/requests/*-response.txt; do
    [ -e "$f" ] || continue
    printf '  %s %s\n' "$(basename "$f" -response.txt)" "$(head -1 "$f")"
done
echo "codex's last message:"
cat "$lab/last-message.txt" 2>/dev/null || echo "  (none)"
grep -h '"type":"error"\|ERROR' "$lab/codex-events.jsonl" "$lab/codex-stderr.txt" | head -5 || true
exit "$rc"
