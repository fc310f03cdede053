//! Forward steps in flight across pipeline stages ([`Command::Launch`], [`Command::Land`]),
//! on a synthetic 5-layer model (stages of uneven length): the rows of steps launched two or
//! three at a time over other sequences, landed in launch order, are the bits of the same
//! steps run one at a time at tp 1 (pp 2, pp 3 and pp 2 x tp 2; a layer does the same
//! arithmetic wherever it runs); a command that must not overtake launched steps (a plain
//! forward, a close of a sequence in flight) lands them first and their rows still come back
//! in order; a stage whose rank leaves is named, with the rank and its host, in the error.

mod common;

use common::{on_staged_workers, on_workers, staged_worker};
use tp_comm::local::{self, LocalOptions};
use tp_engine::protocol::{self, Transport};
use tp_engine::{ChunkSpec, Command, EngineError, Worker};
use tp_models::synthetic::{GgufTypes, SyntheticModel};
use tp_models::{Arch, GgufCheckpoint, LoadOptions};

const CTX: usize = 64;

/// The model as a GGUF file of its own for test `name` (tests run at once).
fn five_layers(name: &str) -> GgufCheckpoint {
    let mut cfg = SyntheticModel::small(Arch::Llama, 5).cfg;
    cfg.layers = 5;
    let path = tp_testkit::scratch_dir("pipeline_flights").join(format!("{name}.gguf"));
    SyntheticModel::new(cfg, 5)
        .write_gguf(&path, GgufTypes::F32)
        .unwrap();
    GgufCheckpoint::open(&path).unwrap()
}

/// The steps: sequences 0..4 in two groups (0 and 2, 1 and 3) taking turns, each a prompt
/// then 4 decode tokens; group `g`'s step `i` is step `2 i + g`.
fn steps() -> Vec<Vec<ChunkSpec>> {
    let feed = |slot: u32, i: usize| -> Vec<u32> {
        if i == 0 {
            (1..6).map(|t| t * 11 + slot).collect()
        } else {
            vec![[7, 300, 42, 9][i - 1] + slot]
        }
    };
    (0..5)
        .flat_map(|i| {
            [0u32, 1].map(|g| {
                [g, g + 2]
                    .iter()
                    .map(|&slot| ChunkSpec::new(slot, feed(slot, i)))
                    .collect()
            })
        })
        .collect()
}

fn open_all(w: &mut Worker) {
    for slot in 0..5 {
        w.submit(Command::Open {
            slot,
            capacity: CTX as u32,
        })
        .unwrap();
    }
}

/// Debug text of a step's whole rows: equal for equal bits.
fn rows(r: tp_engine::StepLogits) -> String {
    format!("{:?}", r.into_full().unwrap())
}

/// One step at a time, then slot 4's lone step.
fn one_at_a_time(w: &mut Worker) -> Vec<String> {
    open_all(w);
    let mut out: Vec<String> = steps()
        .into_iter()
        .map(|s| rows(w.forward_rows(s).unwrap()))
        .collect();
    out.push(rows(
        w.forward_rows(vec![ChunkSpec::new(4, vec![5, 6])]).unwrap(),
    ));
    out
}

/// `depth` steps in flight: launch, and land the oldest once `depth` are in flight; after
/// the 4th launch a plain forward of slot 4 (which lands them first) comes between.
fn in_flight(w: &mut Worker, depth: usize) -> Vec<String> {
    open_all(w);
    let mut out = Vec::new();
    let mut lone = None;
    let mut flying = 0;
    for (i, s) in steps().into_iter().enumerate() {
        w.launch(s).unwrap();
        flying += 1;
        if i == 3 {
            lone = Some(rows(
                w.forward_rows(vec![ChunkSpec::new(4, vec![5, 6])]).unwrap(),
            ));
        }
        if flying == depth {
            out.push(rows(w.land().unwrap()));
            flying -= 1;
        }
    }
    for _ in 0..flying {
        out.push(rows(w.land().unwrap()));
    }
    out.push(lone.unwrap());
    out
}

#[test]
fn steps_in_flight_give_the_bits_of_one_step_at_a_time() {
    let ckpt = five_layers("bits");
    let want = on_workers(&ckpt, 1, LoadOptions::default(), CTX, one_at_a_time);
    assert_eq!(want.len(), 11);
    for (pp, tp, depth) in [(2, 1, 2), (3, 1, 3), (3, 1, 2), (2, 2, 2)] {
        let got = on_staged_workers(&ckpt, pp, tp, CTX, |w| {
            assert_eq!(w.pipeline_depth(), pp);
            in_flight(w, depth)
        });
        assert_eq!(got, want, "pp {pp} x tp {tp}, {depth} in flight");
        // The same workers one step at a time, and a sequence closed while in flight.
        let plain = on_staged_workers(&ckpt, pp, tp, CTX, one_at_a_time);
        assert_eq!(plain, want, "pp {pp} x tp {tp}, one at a time");
    }
    let closed = on_staged_workers(&ckpt, 2, 1, CTX, |w| {
        open_all(w);
        let mut s = steps().into_iter();
        w.launch(s.next().unwrap()).unwrap();
        w.launch(s.next().unwrap()).unwrap();
        // Slot 0 is in the first step: the close lands both steps first.
        w.submit(Command::Close { slot: 0 }).unwrap();
        let rows = [rows(w.land().unwrap()), rows(w.land().unwrap())];
        assert!(w.land().is_err(), "nothing is left in flight");
        rows
    });
    assert_eq!(closed[..], want[..2]);
}

#[test]
fn a_stage_whose_rank_leaves_is_named_with_its_rank_and_host() {
    let ckpt = five_layers("leaves");
    let out = local::run(2, LocalOptions::default(), |g| {
        let mut w = staged_worker(&ckpt, &g, 2, 1, CTX);
        if g.rank() != 0 {
            // Stage 0 takes the opens and the first launch, then leaves without running it.
            for _ in 0..6 {
                protocol::receive(&g, Transport::PointToPoint).unwrap();
            }
            return None;
        }
        open_all(&mut w);
        let mut s = steps().into_iter();
        let err = w
            .launch(s.next().unwrap())
            .and_then(|()| w.launch(s.next().unwrap()))
            .and_then(|()| w.land().map(drop))
            .expect_err("stage 0 is gone");
        Some(err)
    })
    .unwrap();
    let err = out.into_iter().next().unwrap().unwrap().unwrap();
    match &err {
        EngineError::Stage {
            stage,
            stages,
            rank,
            ..
        } => assert_eq!((*stage, *stages, *rank), (0, 2, 1), "{err}"),
        other => panic!("{other}"),
    }
    let text = tp_engine::report::chain(&err);
    assert!(
        text.contains("pipeline stage 0 of 2 (rank 1 on this host)"),
        "{text}"
    );
    assert!(text.contains("rank 1 is gone"), "{text}");
}
