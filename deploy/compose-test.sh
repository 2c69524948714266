#!/usr/bin/env bash
# make compose-test: the compose stack for real, on a machine that reaches no image registry
# (issue 20). Builds every image from Debian's packages and the project's own sources, runs
# the stack with the tiny config on an internal network, checks it, and takes it down.
#
#   deploy/compose-test.sh            # or: make compose-test
#
# Steps (each one timed; the times are printed at the end and written to $WORK/timings.tsv):
#   engine      a Docker engine: the running one, else Debian's dockerd started here (root;
#               logs and pid under $WORK, stopped again at the end)
#   compose     `docker compose` if the plugin is there, else compose v2 ($COMPOSE_VERSION) built
#               with Go from the module proxy into $WORK/bin (`go install` refuses the module:
#               its go.mod has exclude directives, so it is downloaded and built with go build)
#   debootstrap a minbase rootfs of this machine's Debian release, imported as $DEBIAN_IMAGE
#               (skipped when the image exists; REBUILD_BASE=1 redoes it)
#   images      steadyrl-base/python (Debian's python3), Kafka (Debian's JRE + the broker jars
#               from Maven), Prometheus and Alertmanager (Debian's packages), and steadyrl:0.1.0
#               (target cpu, on the Python base; torch from TORCH_INDEX_URL, default: pip's own
#               index). The legacy builder, no BuildKit; network only for the package installs.
#   up          `compose up -d --no-build` with configs/tiny.yaml and compose/local.yml (internal
#               network, no host port, no Grafana)
#   checks      every service healthy through its HEALTHCHECK (topic-init: exited 0), every
#               Prometheus target up, every alert rule evaluating with health ok, the learner's
#               last step and exit 0
#   down        `compose down -v`; no container, network or volume of the project left
#
# Exits non-zero on the first failure (the containers' logs go to $WORK/logs first).
# Environment: WORK (default /var/tmp/steadyrl-ci), COMPOSE_PROJECT (steadyrl-ci),
# TORCH_INDEX_URL (empty), WAIT_S (1800: up to the learner's end), KEEP=1 (no down at the end),
# DEBIAN_MIRROR (default: the first URI of this machine's apt sources).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-/var/tmp/steadyrl-ci}
COMPOSE_VERSION=${COMPOSE_VERSION:-v2.40.3}
PROJECT=${COMPOSE_PROJECT:-steadyrl-ci}
WAIT_S=${WAIT_S:-1800}
RELEASE=$(. /etc/os-release && echo "${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}")
DEBIAN_IMAGE=steadyrl-base/debian:$RELEASE
PYTHON_IMAGE=steadyrl-base/python:3.11-$RELEASE
STEADYRL_IMAGE=${STEADYRL_IMAGE:-steadyrl:0.1.0}
KAFKA_IMAGE=steadyrl-local/kafka:$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$ROOT/broker/pom.xml")
PROMETHEUS_IMAGE=steadyrl-local/prometheus:2.42
ALERTMANAGER_IMAGE=steadyrl-local/alertmanager:0.25
# Every heavy command runs at the lowest CPU and I/O priority: this machine is shared.
LOW=(nice -n 19 ionice -c3)
export DOCKER_BUILDKIT=0
mkdir -p "$WORK/logs" "$WORK/bin"
TIMINGS=$WORK/timings.tsv
: > "$TIMINGS"

say() { printf '[compose-test %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { say "FAIL: $*"; exit 1; }
# step NAME CMD...: run, time it, record it.
step() {
  local name=$1 t0 rc=0
  shift
  say "$name ..."
  t0=$(date +%s.%N)
  "$@" || rc=$?
  local dt
  dt=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$t0" "$(date +%s.%N)")
  printf '%s\t%s\n' "$name" "$dt" >> "$TIMINGS"
  [ "$rc" = 0 ] || die "$name (exit $rc, after ${dt} s)"
  say "$name: ${dt} s"
}

# ------------------------------------------------------------------ engine
STARTED_DOCKERD=
start_engine() {
  if docker info >/dev/null 2>&1; then say "engine: already running"; return; fi
  command -v dockerd >/dev/null || die "no Docker engine and no dockerd (apt-get install docker.io)"
  [ "$(id -u)" = 0 ] || die "no Docker engine running, and starting dockerd needs root"
  "${LOW[@]}" dockerd > "$WORK/dockerd.log" 2>&1 &
  echo $! > "$WORK/dockerd.pid"
  STARTED_DOCKERD=$(cat "$WORK/dockerd.pid")
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
  die "dockerd did not answer within 60 s ($WORK/dockerd.log)"
}
stop_engine() {
  [ -n "$STARTED_DOCKERD" ] || return 0
  say "stopping the dockerd this script started (pid $STARTED_DOCKERD)"
  kill "$STARTED_DOCKERD" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || return 0; sleep 1; done
}

# ------------------------------------------------------------------ compose
COMPOSE=()
find_compose() {
  if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); return; fi
  local bin=$WORK/bin/docker-compose
  if ! [ -x "$bin" ] || [[ "$("$bin" version 2>/dev/null)" != *"$COMPOSE_VERSION"* ]]; then
    command -v go >/dev/null || die "no docker compose plugin and no Go to build it"
    local dir
    dir=$("${LOW[@]}" go mod download -json "github.com/docker/compose/v2@$COMPOSE_VERSION" |
          python3 -c "import json, sys; print(json.load(sys.stdin)['Dir'])")
    (cd "$dir" && "${LOW[@]}" go build -trimpath -o "$bin" \
       -ldflags "-s -w -X github.com/docker/compose/v2/internal.Version=$COMPOSE_VERSION" ./cmd)
  fi
  COMPOSE=("$bin")
}

# ------------------------------------------------------------------ images
debian_base() {
  if docker image inspect "$DEBIAN_IMAGE" >/dev/null 2>&1 && [ -z "${REBUILD_BASE:-}" ]; then
    say "$DEBIAN_IMAGE exists"; return
  fi
  command -v debootstrap >/dev/null || die "debootstrap missing (apt-get install debootstrap)"
  local mirror=${DEBIAN_MIRROR:-} rootfs=$WORK/rootfs
  if [ -z "$mirror" ]; then
    mirror=$(sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*\).*/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk 'NR == 1')
  fi
  if [ -z "$mirror" ]; then
    mirror=$(sed -n 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]*\).*/\2/p' /etc/apt/sources.list 2>/dev/null | awk 'NR == 1')
  fi
  [ -n "$mirror" ] || die "no Debian mirror found in the apt sources: set DEBIAN_MIRROR"
  rm -rf "$rootfs"
  "${LOW[@]}" debootstrap --variant=minbase "$RELEASE" "$rootfs" "$mirror" > "$WORK/logs/debootstrap.log" 2>&1 ||
    die "debootstrap failed ($WORK/logs/debootstrap.log)"
  # The machine's own apt sources (security and updates too), no package lists or archives.
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    cp /etc/apt/sources.list.d/debian.sources "$rootfs/etc/apt/sources.list.d/" && rm -f "$rootfs/etc/apt/sources.list"
  fi
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  "${LOW[@]}" tar -C "$rootfs" -c . | "${LOW[@]}" docker import - "$DEBIAN_IMAGE" >/dev/null
  rm -rf "$rootfs"
  docker run --rm --network none "$DEBIAN_IMAGE" /bin/sh -c 'test -f /etc/debian_version' ||
    die "$DEBIAN_IMAGE does not run"
}

build() {  # build TAG CONTEXT [docker build args...]
  local tag=$1 ctx=$2 log
  shift 2
  log=$WORK/logs/build-${tag//[\/:]/_}.log
  "${LOW[@]}" docker build --network host "$@" -t "$tag" "$ctx" > "$log" 2>&1 || { tail -30 "$log" >&2; die "building $tag ($log)"; }
}

python_base() {
  local ctx=$WORK/ctx-python
  rm -rf "$ctx" && mkdir -p "$ctx/certs"
  cp "$ROOT/compose/local/python/Dockerfile" "$ctx/" || die "copying compose/local/python"
  # An egress proxy's CA, where the machine trusts one: the image's pip must trust it too.
  cp /usr/local/share/ca-certificates/*.crt "$ctx/certs/" 2>/dev/null || true
  build "$PYTHON_IMAGE" "$ctx" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE"
}

kafka_image() {
  local ctx=$WORK/ctx-kafka
  rm -rf "$ctx" && mkdir -p "$ctx"
  cp "$ROOT"/compose/local/kafka/{Dockerfile,run-kafka.sh,kafka-broker-api-versions.sh,log4j2.properties} "$ctx/" ||
    die "copying compose/local/kafka"
  "${LOW[@]}" mvn -q -B -Dstyle.color=never -f "$ROOT/compose/local/kafka/pom.xml" dependency:copy-dependencies \
    "-Dlibs.dir=$ctx/libs" > "$WORK/logs/kafka-jars.log" 2>&1 || die "fetching the broker jars ($WORK/logs/kafka-jars.log)"
  build "$KAFKA_IMAGE" "$ctx" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE"
}

steadyrl_image() {
  build "$STEADYRL_IMAGE" "$ROOT" --target cpu --build-arg "BASE_IMAGE=$PYTHON_IMAGE" \
    --build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL:-}"
}

# ------------------------------------------------------------------ the stack
compose() {
  "${COMPOSE[@]}" -p "$PROJECT" -f "$ROOT/compose/docker-compose.yml" -f "$ROOT/compose/local.yml" "$@"
}
export STEADYRL_CONFIG=../configs/tiny.yaml STEADYRL_IMAGE STEADYRL_KAFKA_IMAGE=$KAFKA_IMAGE \
  STEADYRL_PROMETHEUS_IMAGE=$PROMETHEUS_IMAGE STEADYRL_ALERTMANAGER_IMAGE=$ALERTMANAGER_IMAGE
# A robot URL, so that the alert bridge is ready; the internal network reaches no robot.
export STEADYRL_ALERTBRIDGE__DINGTALK_URL="http://robot.invalid/robot/send?access_token=compose-test"

UP_AT=
STACK_UP=
cleanup() {
  local rc=$?
  if [ -n "$STACK_UP" ]; then
    for c in $(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT"); do
      docker logs "$c" > "$WORK/logs/$(docker inspect -f '{{.Name}}' "$c" | tr -d /).log" 2>&1 || true
    done
    if [ -z "${KEEP:-}" ]; then
      compose down -v --remove-orphans -t 30 >/dev/null 2>&1 || true
    fi
  fi
  stop_engine
  exit "$rc"
}
trap cleanup EXIT

container_of() { docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" \
                   --filter "label=com.docker.compose.service=$1" | awk 'NR == 1'; }

# ts of the learner's first and last `step` log lines and the last step's number, as "first last step".
learner_steps() {
  docker logs "$1" 2>&1 | python3 -c '
import json, sys
first = last = step = None
for line in sys.stdin:
    try:
        rec = json.loads(line)
    except ValueError:
        continue
    if isinstance(rec, dict) and rec.get("msg") == "step":
        first = rec["ts"] if first is None else first
        last, step = rec["ts"], rec.get("step")
print(first, last, step)'
}

prometheus_targets_up() {  # prints "up/total"; true when all are up
  docker exec "$(container_of prometheus)" wget -qO- http://localhost:9090/api/v1/targets 2>/dev/null | python3 -c '
import json, sys
t = json.load(sys.stdin)["data"]["activeTargets"]
up = [x for x in t if x["health"] == "up"]
print(f"{len(up)}/{len(t)}", " ".join(sorted(x["labels"]["job"] + ("" if x["health"] == "up" else "(" + x["health"] + ")") for x in t)))
sys.exit(0 if t and len(up) == len(t) else 1)'
}

prometheus_rules_ok() {  # prints "ok/total" and any rule not ok; true when every rule evaluates ok
  docker exec "$(container_of prometheus)" wget -qO- http://localhost:9090/api/v1/rules 2>/dev/null | python3 -c '
import json, sys
rules = [r for g in json.load(sys.stdin)["data"]["groups"] for r in g["rules"]]
bad = [f"{r['name']}({r['health']}: {r.get('lastError', '')})" for r in rules if r["health"] != "ok"]
print(f"{len(rules) - len(bad)}/{len(rules)}", " ".join(bad))
sys.exit(0 if rules and not bad else 1)'
}

run_stack() {
  UP_AT=$(date +%s.%N)
  STACK_UP=1
  compose up -d --no-build > "$WORK/logs/compose-up.log" 2>&1 || { cat "$WORK/logs/compose-up.log" >&2; die "compose up"; }
  say "up: $(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$UP_AT" "$(date +%s.%N)") s for compose up -d itself"
}

LONG_RUNNING=(kafka reward-server actor rollout reward learner alertbridge prometheus alertmanager)
wait_stack() {
  declare -A healthy_at=()
  local deadline=$(( $(date +%s) + WAIT_S )) targets_ok= rules_ok= learner first last stepno status code
  local steps
  steps=$(sed -n 's/^  steps:[[:space:]]*\([0-9]*\).*/\1/p' "$ROOT/configs/tiny.yaml")
  [ -n "$steps" ] || die "no learner.steps in configs/tiny.yaml"
  while :; do
    [ "$(date +%s)" -lt "$deadline" ] || die "the learner did not finish within $WAIT_S s"
    for svc in "${LONG_RUNNING[@]}"; do
      [ -z "${healthy_at[$svc]:-}" ] || continue
      local c
      c=$(container_of "$svc")
      [ -n "$c" ] || continue
      if [ "$(docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{end}}' "$c")" = healthy ]; then
        healthy_at[$svc]=$(date +%s.%N)
        say "healthy: $svc after $(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$UP_AT" "${healthy_at[$svc]}") s"
      fi
    done
    if [ -z "$targets_ok" ] && [ "${#healthy_at[@]}" = "${#LONG_RUNNING[@]}" ]; then
      local t
      if t=$(prometheus_targets_up); then targets_ok=1; say "prometheus targets all up: $t"; fi
    fi
    if [ -n "$targets_ok" ] && [ -z "$rules_ok" ]; then
      local r
      if r=$(prometheus_rules_ok); then rules_ok=1; say "prometheus rules all evaluate ok: $r"; fi
    fi
    learner=$(container_of learner)
    status=$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}} {{.RestartCount}}' "$learner")
    read -r status code restarts <<< "$status"
    if [ "$status" = exited ]; then break; fi
    sleep 3
  done
  read -r first last stepno <<< "$(learner_steps "$learner")"
  [ "$code" = 0 ] || die "the learner exited $code"
  [ "$restarts" = 0 ] || say "note: the learner was restarted $restarts times"
  [ "$stepno" = "$steps" ] || die "the learner's last step is $stepno, not $steps"
  # Read once into a file: `docker logs | grep -q` fails under pipefail (SIGPIPE).
  docker logs "$learner" > "$WORK/logs/learner.final.log" 2>&1
  grep '^SUMMARY ' "$WORK/logs/learner.final.log" >&2 || die "no SUMMARY from the learner"
  local ti
  ti=$(container_of topic-init)
  [ "$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$ti")" = "exited 0" ] || die "topic-init did not exit 0"
  for svc in "${LONG_RUNNING[@]}"; do
    [ -n "${healthy_at[$svc]:-}" ] || die "$svc never became healthy"
  done
  [ -n "$targets_ok" ] || die "Prometheus never had every target up while the stack ran"
  [ -n "$rules_ok" ] || die "not every alert rule evaluated ok while the stack ran: $(prometheus_rules_ok || true)"
  python3 - "$UP_AT" "$first" "$last" "$stepno" >> "$TIMINGS" <<'EOF'
import sys
up, first, last, n = map(float, sys.argv[1:])
print(f"up to first trained step\t{first - up:.1f}")
print(f"up to last step ({int(n)})\t{last - up:.1f}")
EOF
}

take_down() {
  compose down -v --remove-orphans -t 30 > "$WORK/logs/compose-down.log" 2>&1 || die "compose down"
  STACK_UP=
  local left
  left=$( { docker ps -aq --filter "label=com.docker.compose.project=$PROJECT"
            docker network ls -q --filter "label=com.docker.compose.project=$PROJECT"
            docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT"; } | wc -l)
  [ "$left" = 0 ] || die "$left containers, networks or volumes of $PROJECT left after down -v"
}

image_sizes() {
  for i in "$DEBIAN_IMAGE" "$PYTHON_IMAGE" "$KAFKA_IMAGE" "$PROMETHEUS_IMAGE" "$ALERTMANAGER_IMAGE" "$STEADYRL_IMAGE"; do
    printf 'size %s\t%s MB\n' "$i" "$(docker image inspect -f '{{.Size}}' "$i" | awk '{printf "%.0f", $1 / 1e6}')"
  done >> "$TIMINGS"
}

step engine start_engine
step compose find_compose
say "compose: $("${COMPOSE[@]}" version)"
step "debian base ($DEBIAN_IMAGE)" debian_base
step "python base" python_base
step "kafka image" kafka_image
step "prometheus image" build "$PROMETHEUS_IMAGE" "$ROOT/compose/local/prometheus" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE"
step "alertmanager image" build "$ALERTMANAGER_IMAGE" "$ROOT/compose/local/alertmanager" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE"
step "steadyrl image" steadyrl_image
image_sizes
step "compose up" run_stack
step "stack run (healthy, learner to its last step)" wait_stack
step "compose down -v" take_down
say "PASS"
column -t -s $'\t' "$TIMINGS" >&2 || cat "$TIMINGS" >&2
