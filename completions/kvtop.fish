# fish completion for kvtop — generated from its CLI by `make completions`; do not edit.
# Install: copy this file to ~/.config/fish/completions/kvtop.fish
complete -c kvtop -f
complete -c kvtop -l socket -r -F -d 'Control socket default, KVTOP_SOCKET, else XDG_RUNTIME_DIR/kvtop-UID/engine.sock'
complete -c kvtop -l interval -x -d 'Seconds between polls 0.05 to 3600.'
complete -c kvtop -l readonly -d 'No actions, drain, resume, evict and snapshot are removed.'
complete -c kvtop -l replay -r -F -d 'Replay a .kvsnap snapshot instead of watching an engine.'
complete -c kvtop -l url -x -d 'Any engines Prometheus /metrics vLLM, SGLang, llama.cpp, kvtop repeat it for a f'
complete -c kvtop -l engine -x -d 'With --url, vllm, sglang, llamacpp or kvtop default, detected.'
complete -c kvtop -l targets -r -F -d 'A fleet, a file with one engine URL per line # comments.'
complete -c kvtop -l prometheus -x -d 'A fleet, every engine this Prometheus server scrapes its base URL.'
complete -c kvtop -l version -d 'Print the version and exit.'
complete -c kvtop -l help -d 'Show help and exit.'
