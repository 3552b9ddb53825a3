#!/usr/bin/env bash
# Coverage-guided fuzzing of the native core's parsers with libFuzzer:
#   tools/libfuzzer.sh [PYTHON] [SECONDS per fuzzer, default 120]
# Builds tests/fuzz/*_fuzzer.cc against the core's sources with clang
# (-fsanitize=fuzzer,address,undefined; apt-get install clang), runs each
# for SECONDS from an empty corpus, and prints its executions, libFuzzer's
# coverage counters and the line coverage of the core's files that the
# corpus it grew reaches (a second, instrumented build run over the corpus).
# FUZZ_CORPUS=DIR keeps the corpora there (default: a temporary directory).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD

PY=${1:-${PYTHON:-python3}}
SECS=${2:-120}
CXX=${CXX:-clang++}
command -v "$CXX" >/dev/null || { echo "libfuzzer.sh: no $CXX (apt-get install clang)" >&2; exit 1; }
ver=$("$CXX" --version | sed -nE 's/.*clang version ([0-9]+).*/\1/p' | head -1)
profdata=$(command -v "llvm-profdata-$ver" || command -v llvm-profdata)
cov=$(command -v "llvm-cov-$ver" || command -v llvm-cov)

read -r pyinc pylib pyver < <("$PY" -c 'import sysconfig as s; print(s.get_paths()["include"], s.get_config_var("LIBDIR"), s.get_config_var("LDVERSION"))')
work=${FUZZ_CORPUS:-$(mktemp -d)}
mkdir -p "$work"
common=(-std=c++17 -g -O1 -Ixla_ext -I"$pyinc" -L"$pylib" -Wl,-rpath,"$pylib" -ldl)
embed=(-lpython"$pyver")

declare -A srcs=(
  [layout]="xla_ext/layout.cc"
  [cai]="xla_ext/cai.cc xla_ext/layout.cc"
  [capsule]="xla_ext/capsule.cc xla_ext/cai.cc xla_ext/layout.cc"
)
rc=0
for name in layout cai capsule; do
  # shellcheck disable=SC2206
  files=(${srcs[$name]})
  libs=()
  [[ $name == layout ]] || libs=("${embed[@]}")
  "$CXX" "${common[@]}" -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    "tests/fuzz/${name}_fuzzer.cc" "${files[@]}" "${libs[@]}" -o "$work/$name" || exit 1
  "$CXX" "${common[@]}" -fsanitize=fuzzer -fprofile-instr-generate -fcoverage-mapping \
    "tests/fuzz/${name}_fuzzer.cc" "${files[@]}" "${libs[@]}" -o "$work/$name.cov" || exit 1
  mkdir -p "$work/corpus_$name"
  # The embedded interpreter keeps its caches until exit: leak checking is
  # for the pure C++ harness only (the CPU suite checks our own leaks).
  leaks=$([[ $name == layout ]] && echo 1 || echo 0)
  (cd "$work" && ASAN_OPTIONS=detect_leaks=$leaks "./$name" -max_total_time="$SECS" -print_final_stats=1 -detect_leaks="$leaks" \
     -rss_limit_mb=4096 "corpus_$name" >"$name.log" 2>&1)
  frc=$?
  execs=$(sed -nE 's/^stat::number_of_executed_units: *([0-9]+)/\1/p' "$work/$name.log" | tail -1)
  last=$(grep -E '^#[0-9]+' "$work/$name.log" | tail -1 | sed -E 's/^#[0-9]+ +[A-Z]+ +//')
  (cd "$work" && LLVM_PROFILE_FILE="$name.profraw" "./$name.cov" -runs=0 "corpus_$name" >/dev/null 2>&1)
  "$profdata" merge -sparse "$work/$name.profraw" -o "$work/$name.profdata"
  lines=$("$cov" report "$work/$name.cov" -instr-profile="$work/$name.profdata" "${files[@]}" \
          2>/dev/null | awk '/^TOTAL/ {print $(NF-5)-$(NF-4)" of "$(NF-5)" lines, "$(NF-3)}')
  per_file=$("$cov" report "$work/$name.cov" -instr-profile="$work/$name.profdata" "${files[@]}" \
             2>/dev/null | awk '/\.cc / {n=split($1,p,"/"); printf "%s %s, ", p[n], $(NF-3)}')
  echo "libfuzzer.sh: ${name}_fuzzer: ${SECS} s, ${execs:-?} executions, exit $frc; $last"
  echo "  line coverage of ${files[*]}: $lines (${per_file%, })"
  if [[ $frc -ne 0 ]]; then
    rc=1
    grep -A25 -E "ERROR|runtime error|deadly signal" "$work/$name.log" | head -40
  fi
done
[[ -n ${FUZZ_CORPUS:-} ]] || rm -rf "$work"
exit $rc
