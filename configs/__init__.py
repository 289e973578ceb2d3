"""Example configs (native YAML and DeepSpeed JSON), shipped as package data."""
