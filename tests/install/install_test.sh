#!/bin/sh
# install_test.sh BUILD_DIR SOURCE_DIR: installs the build into a scratch
# prefix and uses it only from there (no LD_LIBRARY_PATH anywhere).
set -eu
build=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

step() { echo "== $*"; }

step "cmake --install into a custom prefix"
cmake --install "$build" --prefix "$prefix" >/dev/null
libdir=$(dirname "$(find "$prefix" -name 'libllmdd.so.0' | head -1)")

step "the installed tool runs from the prefix (RPATH)"
env -u LD_LIBRARY_PATH "$prefix/bin/llmdd" info --no-probe >/dev/null
env -u LD_LIBRARY_PATH ldd "$prefix/bin/llmdd" | grep -q "libllmdd.so.0 => $prefix/"

step "pkg-config consumer (C)"
flags=$(PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --cflags --libs llmdd)
# shellcheck disable=SC2086
cc -std=c11 -Wall -Werror -o "$tmp/pc_c" "$src/tests/install/consumer.c" \
    $flags -Wl,-rpath,"$libdir"
"$tmp/pc_c"

step "find_package consumer (C and C++)"
mkdir "$tmp/consumer"
cp "$src/tests/install/consumer.c" "$src/tests/install/consumer.cpp" \
    "$tmp/consumer/"
cp "$src/tests/install/CMakeLists.consumer.txt" "$tmp/consumer/CMakeLists.txt"
cmake -S "$tmp/consumer" -B "$tmp/consumer/build" \
    -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_RPATH="$libdir" >/dev/null
cmake --build "$tmp/consumer/build" >/dev/null
"$tmp/consumer/build/consumer_c"
"$tmp/consumer/build/consumer_cpp"

step "a program written for LLM-DataDist, g++ -std=c++17, installed header"
g++ -std=c++17 -o "$tmp/reference_flow" \
    "$src/tests/cpp/reference_flow.cpp" -I"$prefix/include" \
    -L"$libdir" -lllmdd -Wl,-rpath,"$libdir"
"$tmp/reference_flow" | tee "$tmp/flow.out"
grep -q " 0 failed" "$tmp/flow.out"

step "cpack -G DEB, installed into a scratch root"
(cd "$build" && cpack -G DEB -B "$tmp/deb" >/dev/null)
deb=$(ls "$tmp"/deb/llmdd_*.deb)
dpkg-deb -c "$deb" | grep -q "include/llm_datadist/llm_datadist.h"
dpkg-deb -c "$deb" | grep -q "include/llmdd/llmdd.h"
root=$tmp/root
mkdir -p "$root/var/lib/dpkg/info" "$root/var/lib/dpkg/updates"
touch "$root/var/lib/dpkg/status"
dpkg --root="$root" --force-depends --force-script-chrootless \
    --log=/dev/null -i "$deb" >/dev/null
env -u LD_LIBRARY_PATH "$root/usr/bin/llmdd" info --no-probe >/dev/null
"$root/usr/bin/llmdd" --help >/dev/null 2>&1 || true
step "the .deb alone serves its consumers: extracted, and nothing else seen"
# Only the extracted tree's pkg-config files are visible (PKG_CONFIG_LIBDIR
# replaces the system's search path), so a .pc or CMake config that needed
# a -dev package the .deb does not depend on would fail here.
x=$tmp/x
dpkg -x "$deb" "$x"
xlib=$(dirname "$(find "$x" -name 'libllmdd.so.0' | head -1)")
xpc=$xlib/pkgconfig
flags=$(PKG_CONFIG_LIBDIR="$xpc" pkg-config --cflags --libs llmdd)
# shellcheck disable=SC2086
cc -std=c11 -Wall -Werror -o "$tmp/x_pc" "$src/tests/install/consumer.c" \
    $flags -Wl,-rpath,"$xlib"
"$tmp/x_pc"
PKG_CONFIG_LIBDIR="$xpc" pkg-config --print-requires llmdd | (! grep -q .)
mkdir "$tmp/xconsumer"
cp "$src/tests/install/consumer.c" "$src/tests/install/consumer.cpp" \
    "$tmp/xconsumer/"
cp "$src/tests/install/CMakeLists.consumer.txt" "$tmp/xconsumer/CMakeLists.txt"
PKG_CONFIG_LIBDIR="$xpc" cmake -S "$tmp/xconsumer" -B "$tmp/xconsumer/build" \
    -DCMAKE_PREFIX_PATH="$x/usr" -DCMAKE_BUILD_RPATH="$xlib" >/dev/null
cmake --build "$tmp/xconsumer/build" >/dev/null
"$tmp/xconsumer/build/consumer_c"
"$tmp/xconsumer/build/consumer_cpp"
# What the shared objects need at run time is in Depends (shlibdeps).
depends=$(dpkg-deb -f "$deb" Depends)
for lib in libcjson1 libssl3 libmicrohttpd12; do
    case "$depends" in
    *"$lib"*) ;;
    *)
        echo "install_test: Depends lacks $lib: $depends" >&2
        exit 1
        ;;
    esac
done

echo "install_test: 1 passed, 0 failed"
