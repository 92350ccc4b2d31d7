# Sourced by run.sh and experiment/run.sh (the repository root is the working directory): the Python
# that runs everything, with requirements.txt's packages. Sets PYTHON and puts its bin first on PATH.
#   PYTHON given, or a venv active: that Python, checked against requirements.txt (exit 2 on a mismatch;
#     PYTHON_CHECK=0 skips the check: gpucheck's end-to-end run on a box whose own torch is not the pin)
#   else: .venv, created and installed on first use, reinstalled when requirements.txt changes
setup_python() {
    if [ -z "${PYTHON:-}" ] && [ -n "${VIRTUAL_ENV:-}" ]; then
        PYTHON=$VIRTUAL_ENV/bin/python
    fi
    if [ -z "${PYTHON:-}" ]; then
        if [ ! -x .venv/bin/python ]; then
            python3 -m venv .venv
        fi
        # Reinstall only when requirements.txt changed, so a second launch starts at once.
        local want
        want=$(sha256sum requirements.txt | cut -d' ' -f1)
        if [ "$(cat .venv/.requirements.sha256 2>/dev/null)" != "$want" ]; then
            .venv/bin/python -m pip install --disable-pip-version-check -q -r requirements.txt
            echo "$want" > .venv/.requirements.sha256
        fi
        PYTHON=$PWD/.venv/bin/python
    fi
    # A relative or bare PYTHON (python3) as a path: the commands may run from another directory.
    local found
    found=$(command -v "$PYTHON") || { echo "error: PYTHON=$PYTHON: no such interpreter" >&2; exit 2; }
    [[ "$found" == /* ]] || found=$PWD/$found
    PYTHON=$found
    # A given interpreter (an image's own, another venv) may hold another torch: say so in one line
    # instead of a traceback from deep inside the trainer.
    if [ "${PYTHON_CHECK:-1}" != 0 ]; then
        "$PYTHON" experiment/envcheck.py requirements.txt || exit 2
    fi
    export PYTHON
    export PATH="$(dirname "$PYTHON"):$PATH"
}
