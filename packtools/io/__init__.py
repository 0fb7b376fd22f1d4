"""Files on disk: input discovery and readers, atomic writes, mapped-page release, manifests, fingerprints."""
