"""Packaged YAML: arch cost models (costmodel/) and deployment configs (deploy/)."""
