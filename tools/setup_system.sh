#!/usr/bin/env bash
# System packages for the course's system tests and the offline book (run as root; idempotent):
#   chromium       headless browser: the book test opens pages and checks a screenshot
#   libjs-mathjax  MathJax 2.7 in /usr/share/javascript/mathjax: formulas in the book, offline
#   fonts-noto-cjk Noto Sans/Serif CJK: the book's Chinese pages render as glyphs, not boxes
#                  (the book's font stack names it first; the browser test checks the glyphs)
#   slurm-wlm, munge  a real single-node Slurm cluster on localhost (chapter 23's sbatch test)
#   iproute2       ip netns, veth, tc: chapter 22's multi-node launch in network namespaces
# Wired to `./course setup --system`. Without apt, root or a network it warns and exits 0:
# the tests that need these packages then skip with the reason.
set -u

PACKAGES=(chromium libjs-mathjax fonts-noto-cjk slurm-wlm munge iproute2)

step() { printf 'setup --system: %s\n' "$*"; }

if ! command -v apt-get >/dev/null 2>&1; then
    step "warning: apt-get not found; install ${PACKAGES[*]} with your package manager (book and system tests skip without them)"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    step "warning: not root; run: sudo $0   (book and system tests skip without ${PACKAGES[*]})"
    exit 0
fi

missing=()
for pkg in "${PACKAGES[@]}"; do
    if dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        step "$pkg already installed"
    else
        missing+=("$pkg")
    fi
done
if [ "${#missing[@]}" -eq 0 ]; then
    step "nothing to install"
    exit 0
fi

step "apt-get update (about 10 s)"
if ! DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1; then
    step "warning: apt-get update failed (no network?); ${missing[*]} not installed"
    exit 0
fi
step "installing ${missing[*]} (about 1 minute)"
if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    step "warning: apt-get install ${missing[*]} failed; the book builds without MathJax and its browser check skips"
    exit 0
fi
for pkg in "${missing[@]}"; do step "$pkg installed"; done
exit 0
