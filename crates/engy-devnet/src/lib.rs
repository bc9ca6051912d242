//! Protocol doubles and the devnet model (see ARCHITECTURE.md).
