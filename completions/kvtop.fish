# fish completion for kvtop — generated from its CLI by `make completions`; do not edit.
# Install: copy this file to ~/.config/fish/completions/kvtop.fish
complete -c kvtop -f
complete -c kvtop -l socket -r -F -d 'Control socket default, KVTOP_SOCKET, else XDG_RUNTIME_DIR/kvtop-UID/engine.sock'
complete -c kvtop -l interval -x -d 'Seconds between polls.'
complete -c kvtop -l readonly -d 'No actions, drain, resume, evict and snapshot are removed.'
complete -c kvtop -l replay -r -F -d 'Replay a .kvsnap snapshot instead of watching an engine.'
complete -c kvtop -l version -d 'Print the version and exit.'
complete -c kvtop -l help -d 'Show help and exit.'
