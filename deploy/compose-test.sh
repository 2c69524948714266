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
#   secrets     deploy/secrets.sh $WORK/secrets (STEADYRL_SECRETS_DIR): every Kafka principal's
#               password and the HTTP token, kept across runs (issue 21: authentication is on)
#   up          `compose up -d --no-build` with configs/tiny.yaml (learner.steps: $COMPOSE_TEST_STEPS,
#               default 800, so that the run outlasts what follows) and compose/local.yml
#               (internal network, no host port, no Grafana)
#   ready       every service healthy through its HEALTHCHECK (topic-init: exited 0), every
#               Prometheus target up, every alert rule evaluating with health ok
#   chaos       mid-run (deploy/compose_checks.py chaos): `up -d --scale rollout=3 --scale reward=2`,
#               each new replica healthy with partitions of its input topic on its /metrics (via
#               Prometheus) and every replica a target, up; then `kill -9` of the main process
#               (docker inspect's State.Pid) of a rollout, a reward and the learner container,
#               each restarted by its restart policy and healthy again, the learner training on
#   forge       mid-run (deploy/compose_checks.py forge, in a one-off container of topic-init):
#               a forged group on rl.scored and a policy record on rl.policy from the rollout
#               principal, a DLQ record on rl.dlq from the actor principal: TOPIC_AUTHORIZATION_FAILED;
#               the same from a wrong password, an unknown user, no credentials: login refused;
#               none of them on the topics (read as admin); POST /generate, /score, /alert/* 401
#               without a token and with a wrong one, /livez 200 without one
#   learner     the learner's last step, exit 0, SUMMARY
#   audit       the exactly-once audit from the topics (steadyrl.testing.audit.audit_pipeline in a
#               one-off container of the learner's service, as the admin principal): every
#               published prompt trained once (none of the forged ones), none lost, the DLQ not
#               excused, both stages exactly once
#   grafana     every Grafana dashboard query over the run through Prometheus' HTTP API: at least
#               one series, except those compose/grafana/expected-empty.json lists (with why)
#   down        `compose down -v`; no container, network or volume of the project left
#   replicated  (REPLICATED=1) the same stack on the three Kafka nodes (compose/replicated.yml),
#               tiny.yaml's 100 steps: ready, the forgeries against the three nodes, the
#               controllers' listener out of reach from the default network, the learner's last
#               step, the audit as admin, down
#
# Exits non-zero on the first failure (the containers' logs go to $WORK/logs first).
# Environment: WORK (default /var/tmp/steadyrl-ci), COMPOSE_PROJECT (steadyrl-ci),
# TORCH_INDEX_URL (empty), WAIT_S (1800: for each wait), KEEP=1 (no down at the end, the image kept), REPLICATED=1, CHAOS=0 (no
# scale-up or kills; tiny.yaml's 100 steps), COMPOSE_TEST_STEPS (800), SCALE_AT_STEP (5),
# DEBIAN_MIRROR (default: the first URI of this machine's apt sources).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-/var/tmp/steadyrl-ci}
COMPOSE_VERSION=${COMPOSE_VERSION:-v2.40.3}
PROJECT=${COMPOSE_PROJECT:-steadyrl-ci}
WAIT_S=${WAIT_S:-1800}
CHAOS=${CHAOS:-1}
STEPS=${COMPOSE_TEST_STEPS:-800}
SCALE_AT_STEP=${SCALE_AT_STEP:-5}
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
# step NAME CMD...: run, time it, record it. CMD runs on the left of `||`, where `set -e` is off:
# every check in it dies (or returns non-zero) itself.
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

BUILT_IMAGE=
steadyrl_image() {
  BUILT_IMAGE=1
  build "$STEADYRL_IMAGE" "$ROOT" --target cpu --build-arg "BASE_IMAGE=$PYTHON_IMAGE" \
    --build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL:-}"
}

# ------------------------------------------------------------------ the stack
COMPOSE_FILES=(-f "$ROOT/compose/docker-compose.yml" -f "$ROOT/compose/local.yml")
TOPIC_INIT=topic-init      # the one-shot job of the phase (REPLICATED: topic-init-replicated)
BOOT=kafka:9092            # the phase's bootstrap servers
PHASE=                     # prefix of the phase's report files
compose() {
  "${COMPOSE[@]}" -p "$PROJECT" "${COMPOSE_FILES[@]}" "$@"
}
# The stack's config: configs/tiny.yaml with learner.steps = $STEPS, long enough to outlast the
# scale-up and the kills (CHAOS=0: neither, and tiny.yaml's own steps).
CONFIG=$WORK/config/steadyrl.yaml
mkdir -p "$WORK/config" && chmod 755 "$WORK/config"
if [ "$CHAOS" = 1 ]; then
  sed "s/^  steps:[[:space:]]*[0-9]*/  steps: $STEPS/" "$ROOT/configs/tiny.yaml" > "$CONFIG"
else
  cp "$ROOT/configs/tiny.yaml" "$CONFIG"
fi
chmod 644 "$CONFIG"
STEPS=$(sed -n 's/^  steps:[[:space:]]*\([0-9]*\).*/\1/p' "$CONFIG")
BATCH=$(sed -n 's/^  prompts_per_step:[[:space:]]*\([0-9]*\).*/\1/p' "$CONFIG")
[ -n "$STEPS" ] && [ -n "$BATCH" ] || die "no learner.steps or prompts_per_step in $CONFIG"
export STEADYRL_CONFIG=$CONFIG STEADYRL_IMAGE STEADYRL_KAFKA_IMAGE=$KAFKA_IMAGE \
  STEADYRL_PROMETHEUS_IMAGE=$PROMETHEUS_IMAGE STEADYRL_ALERTMANAGER_IMAGE=$ALERTMANAGER_IMAGE
# The stack's secrets (deploy/secrets.sh): kept under $WORK across runs, never in the repository.
SECRETS=$WORK/secrets
export STEADYRL_SECRETS_DIR=$SECRETS
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
  # The steadyrl image this script built (6.8 GB, its venv layer and the build stage under it, which `rmi` prunes
  # as untagged parents) goes too: the disk is shared, and a run here once ran out of it. The
  # base images (1.6 GB together) stay for the next run. KEEP=1 keeps everything.
  if [ -z "${KEEP:-}" ] && [ -n "$BUILT_IMAGE" ]; then
    docker image rm "$STEADYRL_IMAGE" >/dev/null 2>&1 || say "could not remove $STEADYRL_IMAGE"
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
LEARNER_FIRST= LEARNER_LAST=
# Every long-running service healthy, every Prometheus target up, every alert rule ok.
wait_ready() {
  declare -A healthy_at=()
  local deadline=$(( $(date +%s) + WAIT_S )) targets_ok= rules_ok= c
  while [ "${#healthy_at[@]}" != "${#LONG_RUNNING[@]}" ] || [ -z "$targets_ok" ] || [ -z "$rules_ok" ]; do
    [ "$(date +%s)" -lt "$deadline" ] || die "the stack was not ready within $WAIT_S s"
    for svc in "${LONG_RUNNING[@]}"; do
      [ -z "${healthy_at[$svc]:-}" ] || continue
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
    [ "$(docker inspect -f '{{.State.Status}}' "$(container_of learner)")" != exited ] ||
      die "the learner exited before the stack was ready (too few steps? COMPOSE_TEST_STEPS)"
    sleep 3
  done
  [ "$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$(container_of "$TOPIC_INIT")")" = "exited 0" ] ||
    die "$TOPIC_INIT did not exit 0"
}

# Mid-run: --scale rollout=3 --scale reward=2, then SIGKILL of a rollout, a reward and the
# learner container's main process (deploy/compose_checks.py chaos).
chaos() {
  python3 "$ROOT/deploy/compose_checks.py" chaos --project "$PROJECT" --out "$WORK/chaos.json" \
    --steps "$STEPS" --scale-at-step "$SCALE_AT_STEP" --rollout 3 --reward 2 -- \
    "${COMPOSE[@]}" -p "$PROJECT" -f "$ROOT/compose/docker-compose.yml" -f "$ROOT/compose/local.yml" ||
    die "the scale-up and SIGKILL checks failed ($WORK/chaos.json)"
  python3 - "$WORK/chaos.json" >> "$TIMINGS" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"scale-up at learner step\t{r['scale_up_at_step']}")
for n in r["new_replicas"]:
    print(f"new {n['container']}: s to healthy, to partitions {n['partitions']} on /metrics\t{n['healthy_after_s']}, {n['partitions_after_s']}")
print(f"kills at learner step\t{r['kill_at_step']}")
for k in r["kills"]:
    print(f"kill -9 {k['container']}: s to restarted, to healthy\t{k['restarted_after_s']}, {k['healthy_after_s']}")
f = r["learner_first_step_after_kill"]
print(f"kills to the restarted learner's first step ({f['step']})\t{f['after_s']}")
PY
}

# The learner to its last step: exit 0 (restarts by its policy on the way are waited out).
wait_learner() {
  local deadline=$(( $(date +%s) + WAIT_S )) learner status code restarts stepno exited_since=
  learner=$(container_of learner)
  while :; do
    [ "$(date +%s)" -lt "$deadline" ] || die "the learner did not finish within $WAIT_S s"
    read -r status code restarts <<< "$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}} {{.RestartCount}}' "$learner")"
    if [ "$status" = exited ]; then
      [ "$code" = 0 ] && break
      # a failure: its restart policy (on-failure) brings it back within seconds
      exited_since=${exited_since:-$(date +%s)}
      [ $(( $(date +%s) - exited_since )) -lt 60 ] || die "the learner exited $code and was not restarted"
    else
      exited_since=
    fi
    sleep 3
  done
  read -r LEARNER_FIRST LEARNER_LAST stepno <<< "$(learner_steps "$learner")"
  say "the learner exited 0 (restarts: $restarts)"
  [ "$stepno" = "$STEPS" ] || die "the learner's last step is $stepno, not $STEPS"
  # Read once into a file: `docker logs | grep -q` fails under pipefail (SIGPIPE).
  docker logs "$learner" > "$WORK/logs/learner.final.log" 2>&1
  grep '^SUMMARY ' "$WORK/logs/learner.final.log" >&2 || die "no SUMMARY from the learner"
  printf 'learner restarts\t%s\n' "$restarts" >> "$TIMINGS"
  python3 - "$UP_AT" "$LEARNER_FIRST" "$LEARNER_LAST" "$stepno" >> "$TIMINGS" <<'PY'
import sys
up, first, last, n = map(float, sys.argv[1:])
print(f"up to first trained step\t{first - up:.1f}")
print(f"up to last step ({int(n)})\t{last - up:.1f}")
PY
}

# Forged records from principals that may not write them, and from clients that cannot log in,
# mid-run: every one refused by the broker, none on the topics; the HTTP work routes refuse a
# missing or wrong token (deploy/compose_checks.py forge, in a one-off container of topic-init,
# which has every password file).
forge() {
  compose run --rm --no-deps -T "$TOPIC_INIT" python - forge --bootstrap "$BOOT" < "$ROOT/deploy/compose_checks.py" \
    > "$WORK/${PHASE}forge.json" 2> "$WORK/logs/${PHASE}forge.log" || true
  python3 - "$WORK/${PHASE}forge.json" "$PHASE" >> "$TIMINGS" <<'PY' || { tail -30 "$WORK/logs/${PHASE}forge.log" >&2; die "forged records or tokenless HTTP calls were not refused ($WORK/${PHASE}forge.json)"; }
import json, sys
lines = open(sys.argv[1]).read().strip().splitlines()
r = json.loads(lines[-1]) if lines else {"failures": ["no report"]}
for a in r.get("attempts", []):
    why = ("SASL authentication failed" if a.get("login_refused") else
           a["error"] if a["error"] == "TOPIC_AUTHORIZATION_FAILED" else f"not delivered: {a['error']}")
    print(f"{sys.argv[2]}forge: {a['who']} -> {a['topic']}\t{'refused' if a['ok'] else 'NOT REFUSED'} ({why})")
for t, n in r.get("scanned", {}).items():
    print(f"{sys.argv[2]}forge: {t} records read as admin, forged among them\t{n['records']}, {n['forged']}")
for h in r.get("http", []):
    print(f"{sys.argv[2]}forge: HTTP {h['service']} no token, wrong token, other routes' token, /livez\t{h['no_token']}, {h['wrong_token']}, {h.get('other_routes_token')}, {h['livez_no_token']}")
for f in r.get("failures", []):
    print(f, file=sys.stderr)
sys.exit(1 if r.get("failures") else 0)
PY
  say "every forged record and tokenless call refused"
  grep "^${PHASE}forge" "$TIMINGS" >&2
}

# The exactly-once audit from the topics, in a one-off container of the learner's service
# (the image, the learner-state volume, the internal network), as the admin principal (its
# password file mounted beside the learner's): every published prompt trained exactly once, none
# lost (the DLQ not excused), both stages exactly once.
audit() {
  compose run --rm --no-deps -T -v "$SECRETS/kafka-admin:/run/secrets/kafka-admin:ro" \
    -e STEADYRL_KAFKA__USERNAME=admin -e STEADYRL_KAFKA__PASSWORD_FILE=/run/secrets/kafka-admin \
    learner python - audit --steps "$STEPS" --batch "$BATCH" --bootstrap "$BOOT" \
    < "$ROOT/deploy/compose_checks.py" > "$WORK/${PHASE}audit.json" 2> "$WORK/logs/${PHASE}audit.log" || true
  python3 - "$WORK/${PHASE}audit.json" >> "$TIMINGS" <<'PY' || { tail -20 "$WORK/logs/${PHASE}audit.log" >&2; die "the exactly-once audit failed ($WORK/${PHASE}audit.json)"; }
import json, sys
lines = open(sys.argv[1]).read().strip().splitlines()
r = json.loads(lines[-1]) if lines else {"ok": False, "explain": "no report"}
print(f"audit: ok\t{r['ok']}")
if "checks" in r:
    print(f"audit: published ids, publish records, republished ids\t{r['published_ids']}, {r['publish_records']}, {r['republished_ids']}")
    print(f"audit: trained groups, trained twice, lost\t{r['trained']}, {len(r['trained_twice'])}, {r['lost_count']}")
    print(f"audit: dlq records, quarantined\t{r['dlq_records']}, {r['quarantined']}")
    for s in r["stages"]:
        print(f"audit: {s['stage']} stage committed inputs, outputs, duplicated, missing\t{s['inputs_committed']}, {s['outputs']}, {s['duplicated_outputs']}, {s['missing_outputs']}")
print(r.get("explain", ""), file=sys.stderr)
sys.exit(0 if r["ok"] else 1)
PY
  say "exactly-once audit passed"
  grep '^audit' "$TIMINGS" >&2
}

# Every Grafana dashboard query over the run's time range through the real Prometheus.
grafana_queries() {
  python3 "$ROOT/deploy/compose_checks.py" grafana --project "$PROJECT" --out "$WORK/grafana.json" \
    --start "$UP_AT" --end "$LEARNER_LAST" || die "a Grafana query returned no series ($WORK/grafana.json)"
  python3 - "$WORK/grafana.json" >> "$TIMINGS" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"grafana queries: queried, non-empty, expected-empty\t{r['queried']}, {r['non_empty']}, {r['expected_empty']}")
PY
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

# REPLICATED: the controllers' listener (PLAINTEXT, ANONYMOUS a super user) is on the internal
# network kafka-quorum only: from the default network kafka-1:9093 refuses and kafka-1-controller
# does not resolve; from kafka-2 (on kafka-quorum) kafka-1-controller:9093 answers.
quorum_fenced() {
  compose run --rm --no-deps -T "$TOPIC_INIT" python - > "$WORK/logs/quorum.log" 2>&1 <<'PY' || { cat "$WORK/logs/quorum.log" >&2; return 1; }
import socket, sys
bad = []
for host in ("kafka-1", "kafka-2", "kafka-3"):
    try:
        socket.create_connection((host, 9093), timeout=5).close()
        bad.append(f"{host}:9093 reachable from the default network")
    except OSError as e:
        print(f"{host}:9093 from the default network: {e}")
    try:
        socket.getaddrinfo(f"{host}-controller", 9093)
        bad.append(f"{host}-controller resolves on the default network")
    except OSError as e:
        print(f"{host}-controller from the default network: {e}")
print("\n".join(bad), file=sys.stderr)
sys.exit(1 if bad else 0)
PY
  compose exec -T kafka-2 bash -c 'exec 3<>/dev/tcp/kafka-1-controller/9093' ||
    { echo "kafka-2 cannot reach kafka-1-controller:9093" >&2; return 1; }
  printf 'replicated: controllers listener from the default network\t%s\n' "refused, name unknown" >> "$TIMINGS"
  say "the controllers' listener: out of reach from the default network, reachable on kafka-quorum"
}

replicated_phase() {
  COMPOSE_FILES+=(-f "$ROOT/compose/replicated.yml")
  TOPIC_INIT=topic-init-replicated BOOT=kafka-1:9092,kafka-2:9092,kafka-3:9092 PHASE=replicated-
  LONG_RUNNING=(kafka-1 kafka-2 kafka-3 reward-server actor rollout reward learner alertbridge prometheus alertmanager)
  cp "$ROOT/configs/tiny.yaml" "$CONFIG" && chmod 644 "$CONFIG"
  STEPS=$(sed -n 's/^  steps:[[:space:]]*\([0-9]*\).*/\1/p' "$CONFIG")
  printf 'replicated (three Kafka nodes, %s steps)\t-\n' "$STEPS" >> "$TIMINGS"
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
step "secrets (deploy/secrets.sh)" "$ROOT/deploy/secrets.sh" "$SECRETS"
step "compose up" run_stack
step "stack ready (healthy, targets, rules)" wait_ready
step "forged records and tokenless HTTP refused" forge
if [ "$CHAOS" = 1 ]; then step "scale-up and SIGKILLs mid-run" chaos; fi
step "learner to its last step" wait_learner
step "exactly-once audit" audit
step "grafana queries" grafana_queries
step "compose down -v" take_down
if [ "${REPLICATED:-0}" = 1 ]; then
  replicated_phase
  step "replicated: compose up" run_stack
  step "replicated: stack ready (healthy, targets, rules)" wait_ready
  step "replicated: forged records and tokenless HTTP refused" forge
  step "replicated: controllers' listener fenced" quorum_fenced
  step "replicated: learner to its last step" wait_learner
  step "replicated: exactly-once audit" audit
  step "replicated: compose down -v" take_down
fi
say "PASS"
column -t -s $'\t' "$TIMINGS" >&2 || cat "$TIMINGS" >&2
