# bash completion for kvtop — generated from its CLI by `make completions`; do not edit.
# Install: source this file from ~/.bashrc, or copy it to ~/.local/share/bash-completion/completions/kvtop
_kvtop_complete() {
    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}" sub="" i
    case "$prev" in
        --socket) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
        --interval) COMPREPLY=(); return 0 ;;
        --replay) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
        --url) COMPREPLY=(); return 0 ;;
        --engine) COMPREPLY=(); return 0 ;;
        --targets) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
        --prometheus) COMPREPLY=(); return 0 ;;
    esac
    if [[ "$cur" == -* ]]; then
        COMPREPLY=( $(compgen -W "--socket --interval --readonly --replay --url --engine --targets --prometheus --version --help" -- "$cur") )
    fi
    return 0
}
complete -o default -F _kvtop_complete kvtop
