#!/usr/bin/env bash
# tools/openmpi_bundle.sh DIR: copies this machine's Open MPI launcher and runtime (Debian 12's
# Open MPI 4.1: mpirun, its MCA components, PMIx, help texts and the libraries they load, glibc
# and CUDA excepted) into DIR, relocatable: on a machine without Open MPI,
#     . DIR/openmpi-env.sh && mpirun -n 2 …
# runs from DIR. The device check carries it so that several processes can share the GPU
# machine's one GPU (README "GPUs"); that machine has no mpirun of its own.
#
# Relocation: Open MPI finds its components, help files and configuration from its install
# prefix, which OPAL_PREFIX moves; the bundle keeps Debian's layout below the prefix
# (lib/x86_64-linux-gnu/openmpi/lib/openmpi3, share/openmpi, …) and sets the directories that
# are not under it (sysconfdir /etc/openmpi) and PMIx's component path explicitly.
# Checked with the system's copy hidden: tests/tools/openmpi_bundle_check.sh (ctest openmpi_bundle_relocates).
set -euo pipefail

[ $# -eq 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
dest=$1
multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
ompi_lib=/usr/lib/$multiarch/openmpi/lib
pmix=/usr/lib/$multiarch/pmix2
for need in /usr/bin/orterun /usr/bin/orted "$ompi_lib/openmpi3" /usr/share/openmpi "$pmix/lib/pmix"; do
  [ -e "$need" ] || { echo "openmpi_bundle: $need is missing: install openmpi-bin (apt-get install openmpi-bin)" >&2; exit 2; }
done

rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib/$multiarch/openmpi/lib" "$dest/lib/$multiarch/pmix2/lib" "$dest/share" \
  "$dest/etc" "$dest/deplib"
cp -L /usr/bin/orterun /usr/bin/orted "$dest/bin/"
ln -s orterun "$dest/bin/mpirun"
ln -s orterun "$dest/bin/mpiexec"
cp -rL "$ompi_lib/openmpi3" "$dest/lib/$multiarch/openmpi/lib/"
cp -rL "$pmix/lib/pmix" "$dest/lib/$multiarch/pmix2/lib/"
cp -rL /usr/share/openmpi "$dest/share/"
[ -d /usr/share/pmix ] && cp -rL /usr/share/pmix "$dest/share/"
[ -d "$pmix/share" ] && cp -rL "$pmix/share" "$dest/lib/$multiarch/pmix2/"
cp -rL /etc/openmpi "$dest/etc/"

# The libraries all of it loads, but glibc's and the GPU's (the machine has its own).
for f in "$dest"/bin/orterun "$dest"/bin/orted "$dest"/lib/$multiarch/openmpi/lib/openmpi3/*.so \
  "$dest"/lib/$multiarch/pmix2/lib/pmix/*.so "$pmix/lib/libpmix.so.2"; do
  ldd "$f" 2>/dev/null | awk '/=> \//{print $1, $3}'
done | sort -u | while read -r name path; do
  case $name in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libresolv.so*|ld-linux*|libutil.so*) ;;
    libcuda.so*|libcudart.so*|libnvidia*) ;;
    *) cp -L "$path" "$dest/deplib/$name" ;;
  esac
done

cat >"$dest/openmpi-env.sh" <<'EOF'
# Sourced: puts this Open MPI bundle (tools/openmpi_bundle.sh) first on PATH and
# LD_LIBRARY_PATH and tells Open MPI and PMIx where they now live.
_ompi_here=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" && pwd)
_ompi_arch=$(ls "$_ompi_here/lib" | head -1)
export PATH="$_ompi_here/bin:$PATH"
export LD_LIBRARY_PATH="$_ompi_here/deplib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OPAL_PREFIX="$_ompi_here"
export OPAL_SYSCONFDIR="$_ompi_here/etc/openmpi"
export OPAL_PKGDATADIR="$_ompi_here/share/openmpi"
export OPAL_LIBDIR="$_ompi_here/lib/$_ompi_arch/openmpi/lib"
export OPAL_PKGLIBDIR="$_ompi_here/lib/$_ompi_arch/openmpi/lib/openmpi3"
export PMIX_INSTALL_PREFIX="$_ompi_here/lib/$_ompi_arch/pmix2"
export PMIX_MCA_mca_base_component_path="$_ompi_here/lib/$_ompi_arch/pmix2/lib/pmix"
export OMPI_MCA_mca_base_component_path="$_ompi_here/lib/$_ompi_arch/openmpi/lib/openmpi3"
unset _ompi_here _ompi_arch
EOF
du -sh "$dest" | awk '{print "openmpi_bundle: " $1 " in " $2}'
