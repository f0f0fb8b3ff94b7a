"""Images from OCI registries: references, manifests and the puller."""
