"""Small building blocks every subsystem shares: addresses, durations and sizes, configuration
field types, and safe file-system operations. Nothing here imports another part of gpuscope."""
