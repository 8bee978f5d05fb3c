"""The Kubernetes CSI node plugin (`objcache csi-node`) and its protocol: csi.proto and the
modules grpcio-tools generates from it (scripts/gen-csi.sh)."""
