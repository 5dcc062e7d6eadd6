//! The admission round (`buffer_core::workload::run_round`) run for a long time on one buffer, printing
//! the cost per cycle of each window of 5 000 rounds, so that a cost that depends on how many groups
//! have passed through the buffer (not only on how many are in flight) shows up:
//!
//! `cargo run --release -p buffer_core --features workload --example rounds_over_time -- 1000000 16`
//! (groups kept in flight, windows).

use std::time::Instant;

use buffer_core::workload::{prefilled, run_round, ROUND};

const ROUNDS_PER_WINDOW: usize = 5_000;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let in_flight: usize = args.next().unwrap_or_else(|| "1000000".into()).parse()?;
    let windows: usize = args.next().unwrap_or_else(|| "16".into()).parse()?;
    let buffer = prefilled(in_flight, 1);
    let mut group_ids = Vec::with_capacity(ROUND);
    for window in 0..windows {
        let start = Instant::now();
        for _ in 0..ROUNDS_PER_WINDOW {
            run_round(&buffer, &mut group_ids)?;
        }
        let cycle_ns = start.elapsed().as_nanos() as f64 / (ROUNDS_PER_WINDOW * ROUND) as f64;
        let ids = 2 * in_flight + (window + 1) * ROUNDS_PER_WINDOW * ROUND;
        println!("window {window} (group ids up to {ids}): {cycle_ns:.0} ns per cycle");
    }
    Ok(())
}
