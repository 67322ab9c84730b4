// llama.cpp through node-llama-cpp (a prebuilt llama.cpp from npm, no build): `sequences` prompts of
// `promptLen` token ids, each generating `maxTokens` greedy tokens, all at once in one context (llama.cpp
// batches them), CPU only, `threads` threads. Prints one JSON line: output tokens, seconds.
// Run by benchmarks/quant.py: node llamacpp_node.mjs MODEL SEQUENCES PROMPT_LEN MAX_TOKENS THREADS
import {getLlama} from "node-llama-cpp";

const [modelPath, sequences, promptLen, maxTokens, threads] = process.argv.slice(2);
const n = Number(sequences), len = Number(promptLen), max = Number(maxTokens);
const llama = await getLlama({gpu: false, build: "never", maxThreads: Number(threads), logLevel: "error"});
const model = await llama.loadModel({modelPath});
const context = await model.createContext({
  sequences: n, contextSize: n * (len + max + 16), batchSize: 512, threads: Number(threads),
  // its RAM estimate refused 64 sequences of SmolLM2 (25,600 tokens, ~0.6 GB of f16 KV) on 24 GiB
  ignoreMemorySafetyChecks: true,
});

let seed = 1;
const random = () => (seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648;
const prompt = () => Array.from({length: len}, () => 3 + Math.floor(random() * 49000));

async function generate(sequence, tokens, count) {
  let made = 0;
  for await (const _ of sequence.evaluate(tokens, {temperature: 0})) {
    if (++made >= count) break;
  }
  return made;
}

const seqs = Array.from({length: n}, () => context.getSequence());
await generate(seqs[0], prompt().slice(0, 16), 4);  // warm-up
await seqs[0].clearHistory();
const prompts = seqs.map(() => prompt());
const t0 = performance.now();
const made = await Promise.all(seqs.map((s, i) => generate(s, prompts[i], max)));
const seconds = (performance.now() - t0) / 1000;
console.log(JSON.stringify({tokens: made.reduce((a, b) => a + b, 0), seconds}));
await context.dispose();
await model.dispose();
