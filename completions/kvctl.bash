# bash completion for kvctl — generated from its CLI by `make completions`; do not edit.
# Install: source this file from ~/.bashrc, or copy it to ~/.local/share/bash-completion/completions/kvctl
_kvctl_complete() {
    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}" sub="" i
    for ((i = 1; i < COMP_CWORD; i++)); do
        case "${COMP_WORDS[i]}" in
            -*) ;;
            *) sub="${COMP_WORDS[i]}"; break ;;
        esac
    done
    case "$sub" in
        "")
            COMPREPLY=( $(compgen -W "bench calibrate completion drain evict plan record replay resume run serve snapshot status whatif --version --help" -- "$cur") )
            ;;
        bench)
            case "$prev" in
                --base-url|--url) COMPREPLY=(); return 0 ;;
                --model) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
                --dataset) COMPREPLY=(); return 0 ;;
                --num-prompts) COMPREPLY=(); return 0 ;;
                --input-len) COMPREPLY=(); return 0 ;;
                --output-len) COMPREPLY=(); return 0 ;;
                --groups) COMPREPLY=(); return 0 ;;
                --system-len) COMPREPLY=(); return 0 ;;
                --question-len) COMPREPLY=(); return 0 ;;
                --long-share) COMPREPLY=(); return 0 ;;
                --long-factor) COMPREPLY=(); return 0 ;;
                --file) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
                --request-rate) COMPREPLY=(); return 0 ;;
                --burstiness) COMPREPLY=(); return 0 ;;
                --max-concurrency) COMPREPLY=(); return 0 ;;
                --seed) COMPREPLY=(); return 0 ;;
                --slo) COMPREPLY=(); return 0 ;;
                --api-key) COMPREPLY=(); return 0 ;;
                --scrape-interval) COMPREPLY=(); return 0 ;;
                --json) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
                --trace) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
                --trace-out) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
            esac
            if [[ "$cur" == -* ]]; then
                COMPREPLY=( $(compgen -W "--base-url --url --model --dataset --num-prompts --input-len --output-len --groups --system-len --question-len --long-share --long-factor --file --request-rate --burstiness --max-concurrency --seed --slo --ignore-eos --no-ignore-eos --api-key --scrape-interval --json --trace --trace-out --help" -- "$cur") )
            fi
            ;;
        calibrate)
            case "$prev" in
                --output|-o) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
                --requests) COMPREPLY=(); return 0 ;;
                --max-prompt) COMPREPLY=(); return 0 ;;
                --max-output) COMPREPLY=(); return 0 ;;
                --prompt-seed) COMPREPLY=(); return 0 ;;
                --model|-m) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
                --dtype) COMPREPLY=( $(compgen -W "auto float32 bfloat16 float16" -- "$cur") ); return 0 ;;
                --device) COMPREPLY=(); return 0 ;;
                --kv-cache-memory) COMPREPLY=(); return 0 ;;
                --gpu-memory-utilization) COMPREPLY=(); return 0 ;;
                --block-size) COMPREPLY=(); return 0 ;;
                --max-num-seqs) COMPREPLY=(); return 0 ;;
                --max-num-batched-tokens) COMPREPLY=(); return 0 ;;
                --max-model-len) COMPREPLY=(); return 0 ;;
                --kv-cache-dtype) COMPREPLY=( $(compgen -W "auto fp8_e4m3 int8" -- "$cur") ); return 0 ;;
                --quantization) COMPREPLY=(); return 0 ;;
                --attention-backend) COMPREPLY=( $(compgen -W "auto cpu triton reference" -- "$cur") ); return 0 ;;
                --schedule-policy) COMPREPLY=( $(compgen -W "fcfs lpm" -- "$cur") ); return 0 ;;
                --preemption-mode) COMPREPLY=( $(compgen -W "recompute swap" -- "$cur") ); return 0 ;;
                --cpu-offload-memory) COMPREPLY=(); return 0 ;;
                --seed) COMPREPLY=(); return 0 ;;
                --served-model-name) COMPREPLY=(); return 0 ;;
            esac
            if [[ "$cur" == -* ]]; then
                COMPREPLY=( $(compgen -W "--output -o --requests --max-prompt --max-output --prompt-seed --model -m --dtype --device --kv-cache-memory --gpu-memory-utilization --block-size --max-num-seqs --max-num-batched-tokens --max-model-len --enable-prefix-caching --no-enable-prefix-caching --kv-cache-dtype --quantization --attention-backend --schedule-policy --preemption-mode --cpu-offload-memory --seed --served-model-name --help" -- "$cur") )
            fi
            ;;
        completion)
            case "$prev" in
                --prog) COMPREPLY=(); return 0 ;;
            esac
            if [[ "$cur" == -* ]]; then
                COMPREPLY=( $(compgen -W "--prog --help" -- "$cur") )
            else
                COMPREPLY=( $(compgen -W "bash zsh fish" -- "$cur") )
            fi
            ;;
        drain)
            case "$prev" in
                --socket) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
                --timeout) COMPREPLY=(); return 0 ;;
            esac
            if [[ "$cur" == -* ]]; then
                COMPREPLY=( $(compgen -W "--socket --timeout --abort-after --quiet -q --help" -- "$cur") )
            fi
            ;;
        evict)
            case "$prev" in
                --seq) COMPREPLY=(); return 0 ;;
                --blocks) COMPREPLY=(); return 0 ;;
                --wait) COMPREPLY=(); return 0 ;;
                --socket) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
            esac
            if [[ "$cur" == -* ]]; then
                COMPREPLY=( $(compgen -W "--seq --requeue --no-requeue --prefix-cache --blocks --yes -y --wait --socket --help" -- "$cur") )
            fi
            ;;
        plan)
            case "$prev" in
                --dtype) COMPREPLY=( $(compgen -W "auto float32 bfloat16 float16" -- "$cur") ); return 0 ;;
                --kv-cache-memory) COMPREPLY=(); return 0 ;;
                --memory) COMPREPLY=(); return 0 ;;
                --gpu-memory-utilization) COMPREPLY=(); return 0 ;;
                --block-size) COMPREPLY=(); return 0 ;;
                --quantization) COMPREPLY=(); return 0 ;;
                --device) COMPREPLY=(); return 0 ;;
                --context) COMPREPLY=(); return 0 ;;
            esac
            if [[ "$cur" == -* ]]; then
                COMPREPLY=( $(compgen -W "--dtype --kv-cache-memory --memory --gpu-memory-utilization --block-size --quantization --device --context --json --help" -- "$cur") )
            fi
            ;;
        record)
            case "$prev" in
                --url) COMPREPLY=(); return 0 ;;
                --output|-o) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
                --duration) COMPREPLY=(); return 0 ;;
                --interval) COMPREPLY=(); return 0 ;;
                --engine) COMPREPLY=(); return 0 ;;
                --reason) COMPREPLY=(); return 0 ;;
                --scrape-timeout) COMPREPLY=(); return 0 ;;
            esac
            if [[ "$cur" == -* ]]; then
                COMPREPLY=( $(compgen -W "--url --output -o --duration --interval --engine --reason --force --scrape-timeout --help" -- "$cur") )
            fi
            ;;
        replay)
            case "$prev" in
            esac
            if [[ "$cur" == -* ]]; then
                COMPREPLY=( $(compgen -W "--help" -- "$cur") )
            else
                COMPREPLY=( $(compgen -f -- "$cur") )
            fi
            ;;
        resume)
            case "$prev" in
                --socket) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
            esac
            if [[ "$cur" == -* ]]; then
                COMPREPLY=( $(compgen -W "--socket --help" -- "$cur") )
            fi
            ;;
        run)
            case "$prev" in
                --output|-o) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
                --max-tokens) COMPREPLY=(); return 0 ;;
                --temperature) COMPREPLY=(); return 0 ;;
                --top-p) COMPREPLY=(); return 0 ;;
                --top-k) COMPREPLY=(); return 0 ;;
                --model|-m) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
                --dtype) COMPREPLY=( $(compgen -W "auto float32 bfloat16 float16" -- "$cur") ); return 0 ;;
                --device) COMPREPLY=(); return 0 ;;
                --kv-cache-memory) COMPREPLY=(); return 0 ;;
                --gpu-memory-utilization) COMPREPLY=(); return 0 ;;
                --block-size) COMPREPLY=(); return 0 ;;
                --max-num-seqs) COMPREPLY=(); return 0 ;;
                --max-num-batched-tokens) COMPREPLY=(); return 0 ;;
                --max-model-len) COMPREPLY=(); return 0 ;;
                --kv-cache-dtype) COMPREPLY=( $(compgen -W "auto fp8_e4m3 int8" -- "$cur") ); return 0 ;;
                --quantization) COMPREPLY=(); return 0 ;;
                --attention-backend) COMPREPLY=( $(compgen -W "auto cpu triton reference" -- "$cur") ); return 0 ;;
                --schedule-policy) COMPREPLY=( $(compgen -W "fcfs lpm" -- "$cur") ); return 0 ;;
                --preemption-mode) COMPREPLY=( $(compgen -W "recompute swap" -- "$cur") ); return 0 ;;
                --cpu-offload-memory) COMPREPLY=(); return 0 ;;
                --seed) COMPREPLY=(); return 0 ;;
                --served-model-name) COMPREPLY=(); return 0 ;;
            esac
            if [[ "$cur" == -* ]]; then
                COMPREPLY=( $(compgen -W "--output -o --max-tokens --temperature --top-p --top-k --ignore-eos --no-ignore-eos --json --model -m --dtype --device --kv-cache-memory --gpu-memory-utilization --block-size --max-num-seqs --max-num-batched-tokens --max-model-len --enable-prefix-caching --no-enable-prefix-caching --kv-cache-dtype --quantization --attention-backend --schedule-policy --preemption-mode --cpu-offload-memory --seed --served-model-name --help" -- "$cur") )
            else
                COMPREPLY=( $(compgen -f -- "$cur") )
            fi
            ;;
        serve)
            case "$prev" in
                --log-level) COMPREPLY=( $(compgen -W "critical error warning info debug" -- "$cur") ); return 0 ;;
                --host) COMPREPLY=(); return 0 ;;
                --port) COMPREPLY=(); return 0 ;;
                --socket) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
                --api-key) COMPREPLY=(); return 0 ;;
                --max-queue) COMPREPLY=(); return 0 ;;
                --stats-interval) COMPREPLY=(); return 0 ;;
                --history) COMPREPLY=(); return 0 ;;
                --drain-timeout) COMPREPLY=(); return 0 ;;
                --snapshot-dir) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
                --snapshot-on) COMPREPLY=( $(compgen -W "preemption-storm slo-breach queue-full" -- "$cur") ); return 0 ;;
                --storm-preemptions) COMPREPLY=(); return 0 ;;
                --storm-window) COMPREPLY=(); return 0 ;;
                --slo-ttft) COMPREPLY=(); return 0 ;;
                --slo-itl) COMPREPLY=(); return 0 ;;
                --snapshot-cooldown) COMPREPLY=(); return 0 ;;
                --max-request-body) COMPREPLY=(); return 0 ;;
                --read-timeout) COMPREPLY=(); return 0 ;;
                --request-timeout) COMPREPLY=(); return 0 ;;
                --max-connections) COMPREPLY=(); return 0 ;;
                --max-connections-per-ip) COMPREPLY=(); return 0 ;;
                --model|-m) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
                --dtype) COMPREPLY=( $(compgen -W "auto float32 bfloat16 float16" -- "$cur") ); return 0 ;;
                --device) COMPREPLY=(); return 0 ;;
                --kv-cache-memory) COMPREPLY=(); return 0 ;;
                --gpu-memory-utilization) COMPREPLY=(); return 0 ;;
                --block-size) COMPREPLY=(); return 0 ;;
                --max-num-seqs) COMPREPLY=(); return 0 ;;
                --max-num-batched-tokens) COMPREPLY=(); return 0 ;;
                --max-model-len) COMPREPLY=(); return 0 ;;
                --kv-cache-dtype) COMPREPLY=( $(compgen -W "auto fp8_e4m3 int8" -- "$cur") ); return 0 ;;
                --quantization) COMPREPLY=(); return 0 ;;
                --attention-backend) COMPREPLY=( $(compgen -W "auto cpu triton reference" -- "$cur") ); return 0 ;;
                --schedule-policy) COMPREPLY=( $(compgen -W "fcfs lpm" -- "$cur") ); return 0 ;;
                --preemption-mode) COMPREPLY=( $(compgen -W "recompute swap" -- "$cur") ); return 0 ;;
                --cpu-offload-memory) COMPREPLY=(); return 0 ;;
                --seed) COMPREPLY=(); return 0 ;;
                --served-model-name) COMPREPLY=(); return 0 ;;
            esac
            if [[ "$cur" == -* ]]; then
                COMPREPLY=( $(compgen -W "--log-level --host --port --socket --api-key --max-queue --stats-interval --history --drain-timeout --snapshot-dir --snapshot-on --storm-preemptions --storm-window --slo-ttft --slo-itl --snapshot-cooldown --max-request-body --read-timeout --request-timeout --max-connections --max-connections-per-ip --warmup --no-warmup --model -m --dtype --device --kv-cache-memory --gpu-memory-utilization --block-size --max-num-seqs --max-num-batched-tokens --max-model-len --enable-prefix-caching --no-enable-prefix-caching --kv-cache-dtype --quantization --attention-backend --schedule-policy --preemption-mode --cpu-offload-memory --seed --served-model-name --help" -- "$cur") )
            fi
            ;;
        snapshot)
            case "$prev" in
                --output|-o) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
                --reason) COMPREPLY=(); return 0 ;;
                --socket) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
            esac
            if [[ "$cur" == -* ]]; then
                COMPREPLY=( $(compgen -W "--output -o --reason --force --socket --help" -- "$cur") )
            fi
            ;;
        status)
            case "$prev" in
                --socket) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
                --url) COMPREPLY=(); return 0 ;;
                --engine) COMPREPLY=(); return 0 ;;
                --window) COMPREPLY=(); return 0 ;;
            esac
            if [[ "$cur" == -* ]]; then
                COMPREPLY=( $(compgen -W "--socket --json --url --engine --window --help" -- "$cur") )
            fi
            ;;
        whatif)
            case "$prev" in
                --kv-cache-memory) COMPREPLY=(); return 0 ;;
                --kv-cache-dtype) COMPREPLY=( $(compgen -W "auto fp8_e4m3 int8" -- "$cur") ); return 0 ;;
                --block-size) COMPREPLY=(); return 0 ;;
                --max-num-seqs) COMPREPLY=(); return 0 ;;
                --max-num-batched-tokens) COMPREPLY=(); return 0 ;;
                --max-model-len) COMPREPLY=(); return 0 ;;
                --schedule-policy) COMPREPLY=( $(compgen -W "fcfs lpm" -- "$cur") ); return 0 ;;
                --preemption-mode) COMPREPLY=( $(compgen -W "recompute swap" -- "$cur") ); return 0 ;;
                --cpu-offload-memory) COMPREPLY=(); return 0 ;;
                --load) COMPREPLY=(); return 0 ;;
                --calibration) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
                --sweep) COMPREPLY=(); return 0 ;;
                --points) COMPREPLY=(); return 0 ;;
                --slo) COMPREPLY=(); return 0 ;;
            esac
            if [[ "$cur" == -* ]]; then
                COMPREPLY=( $(compgen -W "--kv-cache-memory --kv-cache-dtype --block-size --max-num-seqs --max-num-batched-tokens --max-model-len --enable-prefix-caching --no-enable-prefix-caching --schedule-policy --preemption-mode --cpu-offload-memory --load --calibration --sweep --points --slo --json --help" -- "$cur") )
            else
                COMPREPLY=( $(compgen -f -- "$cur") )
            fi
            ;;
    esac
    return 0
}
complete -o default -F _kvctl_complete kvctl
