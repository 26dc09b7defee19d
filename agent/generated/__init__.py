"""Generated from proto/ by scripts/generate_protos.sh. Do not edit."""
