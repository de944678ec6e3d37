# Helpers the CLI test scripts share (sourced). No helper waits by the clock: a wait is for a
# line to appear in a file, read as it is written.
pass=0; fail=0
ok() { pass=$((pass+1)); }
bad() { fail=$((fail+1)); echo "FAILED: $*"; }
py() { "${MEMFIT_TEST_PYTHON:-/usr/bin/python3}" - "$@"; }

# A TCP port nothing listens on now (the kernel's choice).
free_port() { py <<'PY'
import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()
PY
}

# wait_for_line FILE TEXT: returns once FILE holds a line containing TEXT (read as it grows);
# non-zero if the writer never writes it (the 600 s bound only keeps a broken run from
# hanging the suite: ctest's own timeout is the same).
wait_for_line() {
  timeout 600 grep -q -m1 -F -- "$2" <(tail -n +1 -F --pid=$$ "$1" 2>/dev/null)
}

# The field of the last line (the summary) of a JSON-lines log.
summary() { py "$1" "$2" <<'PY'
import json, sys
print(json.loads(open(sys.argv[1]).read().splitlines()[-1])[sys.argv[2]])
PY
}
