#!/bin/sh
# spotctl node bootstrap, rendered by spotctl.remote.bootstrap for one node. Safe to run any
# number of times: it installs only what is missing and starts the agent only when it is
# not already running (or when asked to restart because its configuration changed).
#
#   bootstrap.sh ensure [restart]   install deps if missing, (re)start the agent
#   bootstrap.sh worker             set up the training workers' user (below); prints it
#   bootstrap.sh status             is the agent running?
#   bootstrap.sh stop               stop the agent (and its torchrun) if running
#   bootstrap.sh release            stop, disable, and remove the token from this host
#
# Output is `spotctl:` lines only; nothing secret is ever printed (the token stays in
# its 0600 file and the agent reads it from there).
#
# Install (spotctl.remote.package): with a package uploaded to $DIR/pkg, a venv made from
# the image's python ($BASE, chosen by the controller's probe: spotctl.remote.interp; a
# python without ensurepip gets a venv --without-pip and pip from the uploaded pip wheel)
# reuses the image's torch when it has one of at least MIN_TORCH (system site-packages;
# an older one is left unseen and the node gets TORCH_SPEC)
# and gets spotctl's own wheel and its exactly pinned dependencies from the uploaded
# wheelhouse (pip --no-index; pip's configured index only for a pinned wheel that does not
# fit this machine). Nothing is installed by an unpinned name. A python older than some
# pins allow (OLDER_PINS=1) installs spotctl's wheel with its requirements instead, under
# pkg/constraints.txt: the controller's exact versions, except those that dropped a Python
# spotctl runs on, bounded by the controller's version instead (the newest release this
# python takes, from pip's configured index). Without a package, $PY must already have
# spotctl and torch.
#
# Workers' user: with root (uid 0, or sudo with systemd) and TRAIN_USER set, the training
# workers run as TRAIN_USER (a system user, created if missing) and cannot read the node
# token: the agent runs as root to switch its workers to that user and signal them. That
# user gets search (o+x, not listing) on the directories down to the node's, read on the
# venv and the project, and must then be able to run $PY with spotctl and torch, and be
# unable to write anything $PY loads (WRITABLE_CHECK: root runs the agent from it);
# otherwise (or without root) the agent and its workers run as the login user, as this
# line says.
set -eu
umask 077

DIR=@@DIR@@
PY=@@PYTHON@@
VENV=@@VENV@@
BASE=@@BASE_PYTHON@@
TORCH_SPEC=@@TORCH_SPEC@@
MIN_TORCH=@@MIN_TORCH@@
TORCH_DRIVER=@@TORCH_DRIVER@@
OLDER_PINS=@@OLDER_PINS@@
PKG="$DIR/pkg"
UNIT=@@UNIT@@
TRAIN_USER=@@TRAIN_USER@@
WORKER=""
CONFIG="$DIR/agent.json"
PIDFILE="$DIR/agent.pid"
LOG="$DIR/agent.log"
STARTED_FOR="$DIR/agent.worker"  # the workers' user the running agent was started for

SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then SUDO="sudo -n"; fi
fi

mkdir -p "$DIR" "$DIR/work"
chmod 700 "$DIR"

have_systemd() {
    [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1 \
        && { [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; }
}

has() {  # has PYTHON MODULE...: find_spec, not import (importing torch costs seconds)
    p=$1
    shift
    "$p" -c 'import importlib.util as u, sys
sys.exit(0 if all(u.find_spec(m) for m in sys.argv[1:]) else 1)' "$@" >/dev/null 2>&1
}

old_torch() {  # old_torch PYTHON: its torch's version when older than MIN_TORCH, else
    # nothing (read from the metadata, never imported)
    "$1" -c 'import re, sys
from importlib import metadata as md
v = md.version("torch")
m = re.match(r"(\d+)\.(\d+)", v)
if m and (int(m.group(1)), int(m.group(2))) < tuple(map(int, sys.argv[1].split("."))):
    print(v)' "$MIN_TORCH" 2>/dev/null || true
}

pip_q() {
    "$PY" -m pip install --quiet --disable-pip-version-check "$@" >>"$DIR/bootstrap.log" 2>&1
}

make_venv() {  # make_venv [--system-site-packages]
    if has "$BASE" ensurepip && "$BASE" -m venv "$@" "$VENV" >>"$DIR/bootstrap.log" 2>&1; then
        return 0
    fi
    rm -rf "$VENV"
    # No working ensurepip (Debian/Ubuntu without python3-venv): a venv without pip, then
    # pip from the uploaded pip wheel, run from the wheel itself (nothing from an index).
    pipwhl="$PKG/$(cat "$PKG/pip-wheel" 2>/dev/null || true)"
    if [ ! -f "$pipwhl" ]; then
        echo "spotctl: $BASE has no ensurepip (python3-venv) and no pip wheel was uploaded"
        exit 3
    fi
    "$BASE" -m venv --without-pip "$@" "$VENV" >>"$DIR/bootstrap.log" 2>&1 \
        || { echo "spotctl: $BASE -m venv --without-pip failed (see $DIR/bootstrap.log)"; exit 3; }
    "$VENV/bin/python" "$pipwhl/pip" install --quiet --disable-pip-version-check --no-index \
        "$pipwhl" >>"$DIR/bootstrap.log" 2>&1 \
        || { echo "spotctl: installing pip from $pipwhl failed (see $DIR/bootstrap.log)"; exit 3; }
    echo "spotctl: $BASE has no ensurepip: venv made without it, pip from its wheel"
}

install_deps() {
    if [ -z "$VENV" ]; then
        if has "$PY" spotctl torch; then
            echo "spotctl: deps present"
            return 1
        fi
        echo "spotctl: $PY has no spotctl or torch and no package was uploaded"
        exit 3
    fi
    want=$(cat "$PKG/key")
    if [ "$(cat "$VENV/.spotctl-package" 2>/dev/null || true)" = "$want" ] && [ -x "$PY" ]; then
        echo "spotctl: deps present"
        return 1
    fi
    mkdir -p "$(dirname "$VENV")"
    # Nodes sharing a host share the venv: one installs, the others wait for it.
    if command -v flock >/dev/null 2>&1; then
        exec 9>"$VENV.lock"
        flock 9
    fi
    if [ "$(cat "$VENV/.spotctl-package" 2>/dev/null || true)" = "$want" ] && [ -x "$PY" ]; then
        echo "spotctl: deps present"
        return 1
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        image_torch=$(old_torch "$BASE")
        if [ -n "$image_torch" ]; then
            # spotctl's engines need a newer torch than the image's: the venv does not see
            # it (without the system site-packages) and gets TORCH_SPEC below
            echo "spotctl: $BASE has torch $image_torch, older than $MIN_TORCH: installing $TORCH_SPEC"
            make_venv
        elif has "$BASE" torch; then
            # the image's (CUDA) torch, seen through the system site-packages
            make_venv --system-site-packages
            # a base that is itself a venv (e.g. an image's /opt/pytorch): its packages too
            base_sites=$("$BASE" -c 'import site, sys
if sys.prefix != sys.base_prefix: print("\n".join(site.getsitepackages()))')
            if [ -n "$base_sites" ]; then
                purelib=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
                printf '%s\n' "$base_sites" >"$purelib/_spotctl_base.pth"
            fi
        else
            make_venv
        fi
    fi
    wheel="$PKG/$(cat "$PKG/spotctl-wheel")"
    if ! has "$PY" torch; then
        # TORCH_SPEC's CUDA build needs a recent driver: say so before a multi-GB download
        # that could not use the GPUs (no driver answering: nothing to judge)
        driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null \
            | head -n 1 | tr -d ' ' || true)
        case "${driver%%.*}" in
            '' | *[!0-9]*) ;;
            *) if [ "${driver%%.*}" -lt "$TORCH_DRIVER" ]; then
                   echo "spotctl: the NVIDIA driver here is $driver; $TORCH_SPEC needs $TORCH_DRIVER or newer: use an image with torch $MIN_TORCH or newer, or a newer driver"
                   exit 3
               fi ;;
        esac
    fi
    if [ -n "$OLDER_PINS" ]; then
        # spotctl's requirements as this python takes them (pkg/constraints.txt; torch
        # pinned where the image has none: a dependency must not pull another build)
        pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        torch_pin="$DIR/torch-constraint.txt"
        if has "$PY" torch; then : >"$torch_pin"; else printf '%s\n' "$TORCH_SPEC" >"$torch_pin"; fi
        pip_q --find-links "$PKG" -c "$PKG/constraints.txt" -c "$torch_pin" \
            -r "$PKG/requirements-older.txt" "$wheel" \
            || { echo "spotctl: installing spotctl's dependencies for Python $pyver failed: some of this controller's versions need a newer Python, and pip's index gave no older release that fits (see $DIR/bootstrap.log)"; exit 3; }
        echo "spotctl: Python $pyver is older than some of this controller's pins allow: installed the newest releases up to them that it takes"
    fi
    if ! has "$PY" torch; then
        # torch is pinned: an open range would pull a newer (multi-GB) build.
        pip_q --find-links "$PKG" "$TORCH_SPEC" \
            || { echo "spotctl: installing $TORCH_SPEC failed (see $DIR/bootstrap.log)"; exit 3; }
    fi
    if [ -z "$OLDER_PINS" ]; then
        pip_q --no-index --find-links "$PKG" -r "$PKG/requirements.txt" \
            || pip_q --find-links "$PKG" -r "$PKG/requirements.txt" \
            || { echo "spotctl: installing spotctl's pinned dependencies failed (see $DIR/bootstrap.log)"; exit 3; }
    fi
    # this controller's spotctl, replacing any other build of the same version
    pip_q --no-index --no-deps --force-reinstall "$wheel" \
        || { echo "spotctl: installing $wheel failed (see $DIR/bootstrap.log)"; exit 3; }
    echo "$want" >"$VENV/.spotctl-package"
    echo "spotctl: deps installed"
    return 0
}

# Prints the first path the running user could write among what this interpreter loads
# (spotctl.agent.runas.WRITABLE_CHECK, where it is explained; the agent asks again at start)
WRITABLE_CHECK=@@WRITABLE_CHECK@@

search_down_to() {  # o+x on $1 and every directory above it
    d=$1
    while [ -n "$d" ] && [ "$d" != / ] && [ "$d" != . ]; do
        $SUDO chmod o+x "$d" || true
        d=$(dirname "$d")
    done
}

setup_worker() {  # sets WORKER to the user training workers run as ("" = the login user)
    WORKER=""
    [ -n "$TRAIN_USER" ] || return 0
    # the agent must run as root: logged in as root, or through systemd with sudo
    if [ "$(id -u)" != 0 ] && ! have_systemd; then
        echo "spotctl: workers run as $(id -un): no root here to switch them to $TRAIN_USER"
        return 0
    fi
    if ! id -u "$TRAIN_USER" >/dev/null 2>&1; then
        if ! $SUDO useradd --system --user-group --no-create-home --home-dir /nonexistent \
            --shell /usr/sbin/nologin "$TRAIN_USER" >>"$DIR/bootstrap.log" 2>&1 \
            && ! id -u "$TRAIN_USER" >/dev/null 2>&1; then  # (or a parallel node made it)
            echo "spotctl: workers run as $(id -un): could not create user $TRAIN_USER"
            return 0
        fi
    fi
    mkdir -p "$DIR/work"
    search_down_to "$DIR/work"
    if [ -d "$DIR/project" ]; then $SUDO chmod -R o+rX "$DIR/project" || true; fi
    if [ -n "$VENV" ] && [ -d "$VENV" ]; then
        search_down_to "$(dirname "$VENV")"
        $SUDO chmod -R o+rX "$VENV" || true
    fi
    # shellcheck disable=SC2016
    if ! (cd / && $SUDO runuser -u "$TRAIN_USER" -- "$PY" -c 'import importlib.util as u, sys
sys.exit(0 if all(u.find_spec(m) for m in ("spotctl", "torch")) else 1)') \
        >>"$DIR/bootstrap.log" 2>&1 </dev/null; then
        echo "spotctl: workers run as $(id -un): $TRAIN_USER cannot run $PY with spotctl and torch"
        return 0
    fi
    # The agent runs as root from $PY: if the workers' user could change anything that
    # interpreter loads, a training script could run code as root. Asked as that user.
    w=$(cd / && $SUDO runuser -u "$TRAIN_USER" -- "$PY" -I -S -c "$WRITABLE_CHECK" \
        2>>"$DIR/bootstrap.log" </dev/null) || w="(the check failed: see $DIR/bootstrap.log)"
    if [ -n "$w" ]; then
        echo "spotctl: workers run as $(id -un): $TRAIN_USER can write $w, which the root agent's python loads"
        return 0
    fi
    WORKER=$TRAIN_USER
    echo "spotctl: workers run as $WORKER"
}

fallback_pid() {
    # The recorded pid counts only if that process still runs this node's agent config.
    [ -s "$PIDFILE" ] || return 1
    pid=$(cat "$PIDFILE")
    kill -0 "$pid" 2>/dev/null || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$CONFIG" || return 1
    echo "$pid"
}

running() {
    if have_systemd && [ -f "/etc/systemd/system/$UNIT.service" ]; then
        systemctl is-active --quiet "$UNIT"
    else
        fallback_pid >/dev/null
    fi
}

start_agent() {
    if have_systemd; then
        dst="/etc/systemd/system/$UNIT.service"
        src="$DIR/spotctl-agent.service"
        if [ -n "$WORKER" ]; then
            # root, to run the workers as $WORKER (the agent drops them to that user)
            sed 's/^User=.*/User=root/' "$src" >"$DIR/spotctl-agent.root.service"
            src="$DIR/spotctl-agent.root.service"
        fi
        if ! cmp -s "$src" "$dst" 2>/dev/null; then
            $SUDO install -m 0644 "$src" "$dst"
            $SUDO systemctl daemon-reload
        fi
        $SUDO systemctl enable --quiet "$UNIT" >/dev/null 2>&1 || true
        $SUDO systemctl restart "$UNIT"
        echo "spotctl: agent mode=systemd unit=$UNIT"
        return
    fi
    # No systemd: a session of its own (setsid) so the agent and its torchrun outlive this
    # SSH session and can be stopped as one process group. It writes its own pid before
    # exec, so the pid file names the agent and not a wrapper.
    # shellcheck disable=SC2016
    setsid sh -c 'echo $$ >"$0"; exec "$@"' "$PIDFILE" @@AGENT_ARGV@@ \
        >>"$LOG" 2>&1 </dev/null &
    i=0
    while [ $i -lt 50 ]; do
        if pid=$(fallback_pid); then
            echo "spotctl: agent mode=fallback pid=$pid"
            return
        fi
        i=$((i + 1))
        sleep 0.1
    done
    echo "spotctl: agent did not start (see $LOG)"
    exit 4
}

stop_agent() {
    if have_systemd && [ -f "/etc/systemd/system/$UNIT.service" ]; then
        $SUDO systemctl stop "$UNIT" || true
    fi
    if pid=$(fallback_pid); then
        # The whole process group: the agent and the torchrun it supervises.
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
        i=0
        while kill -0 "$pid" 2>/dev/null && [ $i -lt 300 ]; do
            i=$((i + 1))
            sleep 0.1
        done
        kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    rm -f "$PIDFILE" "$STARTED_FOR"
    echo "spotctl: agent stopped"
}

case "${1:-ensure}" in
ensure)
    install_deps && installed=1 || installed=0
    setup_worker
    if [ "${2:-}" = restart ] && running; then
        stop_agent >/dev/null
    elif running && [ "$(cat "$STARTED_FOR" 2>/dev/null)" != "$WORKER" ]; then
        # the workers' user changes (e.g. that user can now write what the root agent's
        # python loads): a running agent would go on as it was started
        stop_agent >/dev/null
        echo "spotctl: agent restarted: its workers now run as ${WORKER:-$(id -un)}"
    fi
    if running; then
        echo "spotctl: agent already running"
        echo "spotctl-result installed=$installed agent=running"
    else
        printf '%s' "$WORKER" >"$STARTED_FOR"
        start_agent
        echo "spotctl-result installed=$installed agent=started"
    fi
    ;;
worker)
    setup_worker
    echo "spotctl-result worker=${WORKER:-none}"
    ;;
status)
    if running; then echo "spotctl-result agent=running"; else echo "spotctl-result agent=stopped"; fi
    ;;
stop)
    stop_agent
    ;;
release)
    stop_agent
    if have_systemd && [ -f "/etc/systemd/system/$UNIT.service" ]; then
        $SUDO systemctl disable --quiet "$UNIT" >/dev/null 2>&1 || true
        $SUDO rm -f "/etc/systemd/system/$UNIT.service"
        $SUDO systemctl daemon-reload || true
    fi
    rm -f "$DIR/token"
    echo "spotctl: released"
    ;;
*)
    echo "usage: bootstrap.sh ensure [restart] | worker | status | stop | release" >&2
    exit 2
    ;;
esac
