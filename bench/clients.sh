#!/usr/bin/env bash
# guidellm and lm-evaluation-harness against `jserve serve` on SmolLM2, offline (no Hugging
# Face download: HF_HUB_OFFLINE=1), as docs/serving.md ("Benchmarking and evaluation clients")
# documents them; figures in bench/results/issue44_clients.md. A client that is not installed
# is skipped with a line saying so. Run from anywhere in the checkout; PORT (default 8765).
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8765}
URL=http://127.0.0.1:$PORT
WORK=$(mktemp -d)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

jserve export-tokenizer "$WORK/smollm2-tokenizer"
jserve serve smollm2-135m --served-model-name HuggingFaceTB/SmolLM2-135M-Instruct smollm2-135m \
  --port "$PORT" --max-num-seqs 16 --swap-space 0 &
SERVER=$!
trap 'kill -TERM $SERVER; wait $SERVER || true; rm -rf "$WORK"' EXIT
# /health answers 503 while the model loads and compiles, 200 once it serves
until [ "$(curl -s -o /dev/null -w '%{http_code}' "$URL/health")" = 200 ]; do sleep 2; done

if command -v guidellm > /dev/null; then
  for format in /v1/completions /v1/chat/completions; do
    guidellm run \
      --backend "kind=openai_http,target=$URL,request_format=$format" \
      --tokenizer "kind=hf_auto,model=$WORK/smollm2-tokenizer" \
      --data kind=synthetic_text,prompt_tokens=64,output_tokens=32 \
      --profile kind=concurrent,streams=4 --constraint kind=max_requests,count=24 \
      --output kind=console --disable-progress
  done
else
  echo "guidellm is not installed: skipped (pip install guidellm)"
fi

if command -v lm_eval > /dev/null; then
  lm_eval --model local-completions \
    --model_args "model=HuggingFaceTB/SmolLM2-135M-Instruct,base_url=$URL/v1/completions,tokenizer_backend=remote,max_retries=1" \
    --batch_size 8 --tasks jserve_mc --include_path bench/clients
else
  echo "lm_eval is not installed: skipped (pip install 'lm-eval[api]')"
fi
