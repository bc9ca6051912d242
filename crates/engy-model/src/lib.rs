//! The tiny devnet model (see ARCHITECTURE.md).
