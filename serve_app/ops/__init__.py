"""Operator tools: doctor, the KubeRay manifest, dashboards push."""
