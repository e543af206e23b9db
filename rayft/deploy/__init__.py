"""Deployment: KubeRay manifests rendered from a training config, and their validation against the CRDs."""
