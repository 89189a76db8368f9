#include "engine/train/demo_data.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <span>
#include <string_view>
#include <system_error>
#include <vector>

#include "common/error.hpp"
#include "engine/train/token_file.hpp"

namespace outcore::train {
namespace {

// splitmix64: a tiny generator whose output is fixed by its seed on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n) by rejection (no modulo bias). REQUIRES n > 0.
  uint64_t below(uint64_t n) {
    uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do x = next();
    while (x >= limit);
    return x % n;
  }
  template <typename T, size_t N>
  const T& pick(const std::array<T, N>& a) {
    return a[below(N)];
  }
  bool chance(unsigned percent) { return below(100) < percent; }

 private:
  uint64_t s_;
};

using W = std::string_view;

constexpr std::array<W, 24> kNames = {"Tom",  "Anna", "Ben",   "Lily",  "Max",  "Sara",
                                      "Sam",  "Mia",  "Leo",   "Emma",  "Jack", "Zoe",
                                      "Ella", "Noah", "Lucy",  "Finn",  "Ivy",  "Oscar",
                                      "Ruby", "Hugo", "Alice", "Felix", "Nora", "Theo"};
struct Noun {
  W one, many;
};
constexpr std::array<Noun, 30> kNouns = {{
    {"cat", "cats"},       {"dog", "dogs"},       {"bird", "birds"},   {"fox", "foxes"},
    {"ball", "balls"},     {"box", "boxes"},      {"tree", "trees"},   {"house", "houses"},
    {"boat", "boats"},     {"cake", "cakes"},     {"apple", "apples"}, {"book", "books"},
    {"hat", "hats"},       {"cup", "cups"},       {"fish", "fish"},    {"frog", "frogs"},
    {"garden", "gardens"}, {"river", "rivers"},   {"hill", "hills"},   {"star", "stars"},
    {"flower", "flowers"}, {"kite", "kites"},     {"train", "trains"}, {"shoe", "shoes"},
    {"bear", "bears"},     {"mouse", "mice"},     {"horse", "horses"}, {"duck", "ducks"},
    {"window", "windows"}, {"pencil", "pencils"},
}};
constexpr std::array<W, 20> kAdjectives = {
    "big",   "small", "red",  "blue", "green",  "happy", "sad",  "old",   "new",   "little",
    "funny", "quiet", "warm", "cold", "bright", "soft",  "tall", "brave", "shiny", "sleepy"};
struct Verb {
  W base, third, past;
};
constexpr std::array<Verb, 18> kVerbs = {{
    {"see", "sees", "saw"},
    {"find", "finds", "found"},
    {"like", "likes", "liked"},
    {"want", "wants", "wanted"},
    {"take", "takes", "took"},
    {"make", "makes", "made"},
    {"paint", "paints", "painted"},
    {"hold", "holds", "held"},
    {"chase", "chases", "chased"},
    {"help", "helps", "helped"},
    {"draw", "draws", "drew"},
    {"wash", "washes", "washed"},
    {"carry", "carries", "carried"},
    {"hide", "hides", "hid"},
    {"open", "opens", "opened"},
    {"build", "builds", "built"},
    {"love", "loves", "loved"},
    {"catch", "catches", "caught"},
}};
constexpr std::array<W, 8> kPlaces = {"in the garden", "by the river",    "on the hill",
                                      "at the park",   "in the house",    "near the tree",
                                      "at school",     "under the bridge"};
constexpr std::array<W, 8> kTimes = {"In the morning", "One day",   "After lunch", "At night",
                                     "On Sunday",      "Every day", "Later",       "Yesterday"};
constexpr std::array<W, 21> kNumbers = {
    "zero",     "one",     "two",     "three",     "four",     "five",     "six",
    "seven",    "eight",   "nine",    "ten",       "eleven",   "twelve",   "thirteen",
    "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"};
constexpr std::array<W, 7> kDays = {"Monday", "Tuesday",  "Wednesday", "Thursday",
                                    "Friday", "Saturday", "Sunday"};
struct Fact {
  W question, answer;
};
constexpr std::array<Fact, 12> kFacts = {{
    {"What color is the sky?", "The sky is blue."},
    {"What color is the grass?", "The grass is green."},
    {"How many legs does a cat have?", "A cat has four legs."},
    {"How many legs does a bird have?", "A bird has two legs."},
    {"What do cows drink?", "Cows drink water."},
    {"Where do fish live?", "Fish live in the river."},
    {"What comes after Monday?", "Tuesday comes after Monday."},
    {"What is two plus two?", "Two plus two is four."},
    {"When do we sleep?", "We sleep at night."},
    {"What color is the sun?", "The sun is yellow."},
    {"Where do birds sleep?", "Birds sleep in the trees."},
    {"What falls from the clouds?", "Rain falls from the clouds."},
}};

class Writer {
 public:
  Writer(uint64_t seed, std::string& out) : rng_(seed), out_(out) {}

  void document() {
    int sentences = 3 + static_cast<int>(rng_.below(6));
    W hero = rng_.pick(kNames);
    for (int i = 0; i < sentences; ++i) {
      if (i > 0) out_ += ' ';
      sentence(hero);
    }
    out_ += '\n';
  }

 private:
  void put(W w) { out_.append(w); }
  template <typename... A>
  void f(fmt::format_string<A...> s, A&&... a) {
    fmt::format_to(std::back_inserter(out_), s, std::forward<A>(a)...);
  }
  W article_adj() { return rng_.chance(50) ? rng_.pick(kAdjectives) : W{}; }
  void noun_phrase(const Noun& n) {  // "the red ball" / "the ball"
    W adj = article_adj();
    if (adj.empty())
      f("the {}", n.one);
    else
      f("the {} {}", adj, n.one);
  }

  void sentence(W hero) {
    switch (rng_.below(9)) {
      case 0: {  // Tom has a red ball.
        W adj = rng_.pick(kAdjectives);
        const Noun& n = rng_.pick(kNouns);
        bool vowel = std::string_view("aeiou").find(adj[0]) != std::string_view::npos;
        f("{} has {} {} {}.", hero, vowel ? "an" : "a", adj, n.one);
        break;
      }
      case 1: {  // One day, Tom saw the little cat in the garden.
        const Verb& v = rng_.pick(kVerbs);
        f("{}, {} {} ", rng_.pick(kTimes), hero, v.past);
        noun_phrase(rng_.pick(kNouns));
        f(" {}.", rng_.pick(kPlaces));
        break;
      }
      case 2: {  // The cat chases the dog. / The cats chase the dogs.
        const Noun& a = rng_.pick(kNouns);
        const Noun& b = rng_.pick(kNouns);
        const Verb& v = rng_.pick(kVerbs);
        if (rng_.chance(50))
          f("The {} {} the {}.", a.one, v.third, b.one);
        else
          f("The {} {} the {}.", a.many, v.base, b.many);
        break;
      }
      case 3: {  // Tom and Anna like to paint.
        W other = rng_.pick(kNames);
        f("{} and {} like to {} together.", hero, other, rng_.pick(kVerbs).base);
        break;
      }
      case 4: {  // Tom counted: three, four, five, six.
        size_t start = rng_.below(12);
        size_t len = 3 + rng_.below(6);
        f("{} counted: ", hero);
        for (size_t k = 0; k < len; ++k) f("{}{}", k ? ", " : "", kNumbers[start + k]);
        put(".");
        break;
      }
      case 5: {  // 3 + 4 = 7.
        uint64_t a = rng_.below(10), b = rng_.below(10);
        if (rng_.chance(60))
          f("{} + {} = {}.", a, b, a + b);
        else
          f("{} - {} = {}.", std::max(a, b), std::min(a, b), std::max(a, b) - std::min(a, b));
        break;
      }
      case 6: {  // Q: What color is the sky? A: The sky is blue.
        const Fact& q = rng_.pick(kFacts);
        f("Q: {} A: {}", q.question, q.answer);
        break;
      }
      case 7: {  // On Monday, then Tuesday, then Wednesday.
        size_t d = rng_.below(7);
        f("{} came, then {}, then {}.", kDays[d], kDays[(d + 1) % 7], kDays[(d + 2) % 7]);
        break;
      }
      default: {  // Tom is happy because the dog is warm.
        const Noun& n = rng_.pick(kNouns);
        f("{} is {} because the {} is {}.", hero, rng_.pick(kAdjectives), n.one,
          rng_.pick(kAdjectives));
        break;
      }
    }
  }

  Rng rng_;
  std::string& out_;
};

void write_bytes_as_tokens(const std::string& path, std::string_view text) {
  std::vector<uint16_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  write_llmc_tokens(path, tokens);
}

}  // namespace

std::string demo_text(uint64_t seed, size_t bytes) {
  std::string out;
  out.reserve(bytes + 1024);
  Writer w(seed, out);
  while (out.size() < bytes) w.document();
  out.resize(bytes);
  return out;
}

DemoDatasetFiles write_demo_dataset(const std::string& dir, const DemoDataOptions& o) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw IoError(dir, ec.value(), "create demo dataset directory");
  DemoDatasetFiles files{(std::filesystem::path(dir) / "demo_train.bin").string(),
                         (std::filesystem::path(dir) / "demo_val.bin").string()};
  // The validation stream has its own seed, so it is new text of the same distribution.
  write_bytes_as_tokens(files.train, demo_text(o.seed, o.train_tokens));
  write_bytes_as_tokens(files.val, demo_text(o.seed ^ 0x5bd1e9955bd1e995ULL, o.val_tokens));
  return files;
}

std::string demo_model_config_json() {
  nlohmann::ordered_json j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["hidden_size"] = 384;
  j["intermediate_size"] = 1152;
  j["num_hidden_layers"] = 6;
  j["num_attention_heads"] = 6;
  j["num_key_value_heads"] = 2;
  j["vocab_size"] = kDemoVocabSize;
  j["max_position_embeddings"] = 256;
  j["rope_theta"] = 10000.0;
  j["rms_norm_eps"] = 1e-5;
  j["tie_word_embeddings"] = false;
  j["hidden_act"] = "silu";
  j["torch_dtype"] = "float32";
  return j.dump(2) + "\n";
}

std::string demo_ds_config_json(int64_t total_steps) {
  if (total_steps < 1) {
    throw InvalidArgument(fmt::format("demo total_steps {} must be >= 1", total_steps));
  }
  nlohmann::ordered_json j;
  j["train_micro_batch_size_per_gpu"] = 8;
  j["gradient_accumulation_steps"] = 1;
  j["gradient_clipping"] = 1.0;
  j["optimizer"] = {
      {"type", "AdamW"},
      {"params", {{"lr", 2e-3}, {"betas", {0.9, 0.95}}, {"eps", 1e-8}, {"weight_decay", 0.1}}}};
  j["scheduler"] = {{"type", "WarmupCosineLR"},
                    {"params",
                     {{"total_num_steps", total_steps},
                      {"warmup_num_steps", std::max<int64_t>(1, total_steps / 20)},
                      {"warmup_type", "linear"},
                      {"warmup_min_ratio", 0.0},
                      {"cos_min_ratio", 0.1}}}};
  j["zero_optimization"] = {{"stage", 0}};
  return j.dump(2) + "\n";
}

}  // namespace outcore::train
