// Reading an untrusted checkpoint header (header.h: ParseHeader).
#include <algorithm>
#include <string_view>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/header.h"
#include "common/crc32c.h"
#include "common/status_macros.h"

// Helpers live in this namespace too, as in header.cc.
namespace optimd {
namespace checkpoint_header {

// A packed tensor's optional shape: at most 64 non-negative integers whose
// product is `numel`.
bool IsShapeOf(const json& shape, uint64_t numel) {
  if (!shape.is_array() || shape.size() > 64) return false;
  uint64_t product = 1;
  for (const json& d : shape) {
    if (!d.is_number_unsigned() ||
        __builtin_mul_overflow(product, d.get<uint64_t>(), &product)) {
      return false;
    }
  }
  return product == numel;
}

// A checkpoint can come from anywhere (a file, a client's stream): every
// header field is checked for presence, type and range before it is used,
// and every problem is a Status naming the field, never an exception.

// Deeper nesting is refused before parsing, so that no recursive walk over
// a parsed value (comparison, printing, destruction) can exhaust the stack.
constexpr int kMaxJsonDepth = 16;

absl::Status Malformed(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, " has a malformed optimd header: ", what,
                   "; the file is damaged or was not written by optimd"));
}

absl::Status CheckJsonDepth(absl::string_view text, const std::string& path) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth) {
        return Malformed(path, absl::StrCat("JSON nested deeper than ",
                                            kMaxJsonDepth, " levels"));
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return absl::OkStatus();
}

// Parses untrusted JSON text without throwing.
absl::StatusOr<json> ParseJson(absl::string_view text, const std::string& path,
                               const std::string& what) {
  OPTIMD_RETURN_IF_ERROR(CheckJsonDepth(text, path));
  json j = json::parse(text.begin(), text.end(), nullptr,
                       /*allow_exceptions=*/false);
  if (j.is_discarded()) return Malformed(path, what + " is not valid JSON");
  return j;
}

// Typed access to the members of one JSON object of a header.
class Fields {
 public:
  // INVALID_ARGUMENT unless `j` is an object.
  static absl::StatusOr<Fields> Of(const json& j, std::string where,
                                   const std::string& path) {
    if (!j.is_object()) return Malformed(path, where + " is not an object");
    return Fields(j, std::move(where), path);
  }

  const std::string& where() const { return where_; }

  absl::StatusOr<const json*> Get(const char* key) const {
    auto it = obj_.find(key);
    if (it == obj_.end()) return Bad(key, "missing");
    return &*it;
  }
  absl::StatusOr<uint64_t> Uint(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (v->is_number_unsigned()) return v->get<uint64_t>();
    if (v->is_number_integer() && v->get<int64_t>() >= 0) {
      return static_cast<uint64_t>(v->get<int64_t>());
    }
    return Bad(key, "not a non-negative integer");
  }
  absl::StatusOr<double> Number(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_number()) return Bad(key, "not a number");
    return v->get<double>();
  }
  absl::StatusOr<bool> Bool(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_boolean()) return Bad(key, "not true or false");
    return v->get<bool>();
  }
  absl::StatusOr<std::string> String(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_string()) return Bad(key, "not a string");
    return v->get<std::string>();
  }
  absl::StatusOr<const json*> Array(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_array()) return Bad(key, "not an array");
    return v;
  }
  // An array of exactly `n` non-negative integers.
  absl::StatusOr<std::vector<uint64_t>> Uints(const char* key, size_t n) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Array(key));
    std::vector<uint64_t> out;
    for (const json& x : *v) {
      if (!x.is_number_unsigned()) break;
      out.push_back(x.get<uint64_t>());
    }
    if (out.size() != n || v->size() != n) {
      return Bad(key, absl::StrCat("not ", n, " non-negative integers"));
    }
    return out;
  }
  // The product of a shape: an array of at most 64 non-negative integers
  // (a tensor's shape; its product must not overflow).
  absl::StatusOr<uint64_t> ShapeNumel(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Array(key));
    uint64_t product = 1;
    bool bad = v->size() > 64;
    for (const json& d : *v) {
      bad = bad || !d.is_number_unsigned() ||
            __builtin_mul_overflow(product, d.get<uint64_t>(), &product);
    }
    if (bad) return Bad(key, "not a shape (at most 64 dimensions)");
    return product;
  }
  absl::Status Bad(const char* key, const std::string& problem) const {
    return Malformed(path_,
                     absl::StrCat(where_, " field '", key, "' is ", problem));
  }

 private:
  Fields(const json& obj, std::string where, const std::string& path)
      : obj_(obj), where_(std::move(where)), path_(path) {}
  const json& obj_;
  std::string where_;
  std::string path_;
};

// A crc32c written as 8 lowercase hex digits.
absl::StatusOr<uint32_t> ParseCrcHex(const std::string& s) {
  uint32_t v = 0;
  for (char c : s) {
    int d = c >= '0' && c <= '9'   ? c - '0'
            : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                   : -1;
    if (d < 0) return absl::InvalidArgumentError("not hex");
    v = v << 4 | static_cast<uint32_t>(d);
  }
  if (s.size() != 8) return absl::InvalidArgumentError("not 8 digits");
  return v;
}

// The optional "missed_steps" of a group: [tensor index, missed] pairs, each
// index once and below `tensors`, each count at most the group's step.
absl::StatusOr<std::vector<uint64_t>> ParseMissedSteps(const json& jg,
                                                       const Fields& f,
                                                       uint64_t step,
                                                       size_t tensors) {
  std::vector<uint64_t> missed(tensors, 0);
  if (!jg.contains("missed_steps")) return missed;
  OPTIMD_ASSIGN_OR_RETURN(const json* pairs, f.Array("missed_steps"));
  for (const json& p : *pairs) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number_unsigned() ||
        !p[1].is_number_unsigned() || p[0].get<uint64_t>() >= tensors ||
        p[1].get<uint64_t>() == 0 || p[1].get<uint64_t>() > step ||
        missed[p[0].get<size_t>()] != 0) {
      return f.Bad(
          "missed_steps",
          absl::StrCat("not a list of distinct [tensor index < ", tensors,
                       ", 1 <= missed <= step ", step, "] pairs"));
    }
    missed[p[0].get<size_t>()] = p[1].get<uint64_t>();
  }
  return missed;
}

// The names a file's aliases must not repeat: its tensor names (which
// ParseGroup has matched with the registered ones) and the aliases read so
// far. The tensor names are indexed on the first alias only, so that a
// file without aliases costs nothing more to load.
class FileNames {
 public:
  explicit FileNames(const std::vector<Group*>& groups) : groups_(groups) {}

  // Takes `alias`; false when it is a tensor name or was taken before.
  bool Take(const std::string& alias) {
    if (!indexed_) {
      for (const Group* g : groups_) {
        for (const TensorEntry& t : g->tensors) tensor_names_.insert(t.name);
      }
      indexed_ = true;
    }
    return tensor_names_.count(alias) == 0 && aliases_.insert(alias).second;
  }

 private:
  const std::vector<Group*>& groups_;
  bool indexed_ = false;
  std::unordered_set<std::string_view> tensor_names_;
  std::unordered_set<std::string> aliases_;
};

// The optional "aliases" of a group: [tensor index, [alias, ...]] pairs,
// each index once and below `tensors`, each with 1 to kMaxAliasesPerTensor
// aliases of 1 to kMaxNameBytes bytes, none a tensor name of the file or
// another alias in it. Per tensor, its aliases (empty without the key).
absl::StatusOr<std::vector<std::vector<std::string>>> ParseAliases(
    const json& jg, const Fields& f, size_t tensors, FileNames* names) {
  std::vector<std::vector<std::string>> out(tensors);
  if (!jg.contains("aliases")) return out;
  OPTIMD_ASSIGN_OR_RETURN(const json* pairs, f.Array("aliases"));
  for (const json& p : *pairs) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number_unsigned() ||
        p[0].get<uint64_t>() >= tensors || !p[1].is_array() || p[1].empty() ||
        p[1].size() > kMaxAliasesPerTensor ||
        !out[p[0].get<size_t>()].empty()) {
      return f.Bad(
          "aliases",
          absl::StrCat("not a list of distinct [tensor index < ", tensors,
                       ", [1 to ", kMaxAliasesPerTensor, " names]] pairs"));
    }
    std::vector<std::string>& mine = out[p[0].get<size_t>()];
    for (const json& a : p[1]) {
      if (!a.is_string() || a.get_ref<const std::string&>().empty() ||
          a.get_ref<const std::string&>().size() > kMaxNameBytes) {
        return f.Bad("aliases", absl::StrCat("listing an alias that is not a "
                                             "string of 1 to ",
                                             kMaxNameBytes, " bytes"));
      }
      const std::string& alias = a.get_ref<const std::string&>();
      if (!names->Take(alias)) {
        return f.Bad("aliases", absl::StrCat("listing '", alias.substr(0, 64),
                                             "', a tensor name or an alias "
                                             "listed before"));
      }
      mine.push_back(alias);
    }
  }
  return out;
}

// Whether `dims` is an array of 1 to 64 unsigned integers (of `size` when
// nonzero).
bool IsDims(const json& dims, size_t size) {
  if (!dims.is_array() || dims.empty() || dims.size() > 64 ||
      (size != 0 && dims.size() != size)) {
    return false;
  }
  for (const json& d : dims) {
    if (!d.is_number_unsigned()) return false;
  }
  return true;
}

// The optional "shards" of a group: [tensor index, global shape, global
// offset] triples, each index once and below `tensors`, shape and offset
// of one length. Informational (a load keeps what the session
// registered), but checked like every other field.
absl::Status CheckShards(const json& jg, const Fields& f, size_t tensors) {
  if (!jg.contains("shards")) return absl::OkStatus();
  OPTIMD_ASSIGN_OR_RETURN(const json* triples, f.Array("shards"));
  std::vector<bool> seen(tensors, false);
  for (const json& t : *triples) {
    if (!t.is_array() || t.size() != 3 || !t[0].is_number_unsigned() ||
        t[0].get<uint64_t>() >= tensors || seen[t[0].get<size_t>()] ||
        !IsDims(t[1], 0) || !IsDims(t[2], t[1].size())) {
      return f.Bad(
          "shards",
          absl::StrCat("not a list of distinct [tensor index < ", tensors,
                       ", global shape, global offset] "
                       "triples (1 to 64 dimensions each)"));
    }
    seen[t[0].get<size_t>()] = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<OptimizerHyper> ParseHyper(const Fields& g,
                                          const std::string& path) {
  OPTIMD_ASSIGN_OR_RETURN(const json* jh, g.Get("hyperparameters"));
  OPTIMD_ASSIGN_OR_RETURN(
      Fields h, Fields::Of(*jh, g.where() + " hyperparameters", path));
  OptimizerHyper out;
  OPTIMD_ASSIGN_OR_RETURN(out.lr, h.Number("lr"));
  OPTIMD_ASSIGN_OR_RETURN(out.beta1, h.Number("beta1"));
  OPTIMD_ASSIGN_OR_RETURN(out.beta2, h.Number("beta2"));
  OPTIMD_ASSIGN_OR_RETURN(out.eps, h.Number("eps"));
  OPTIMD_ASSIGN_OR_RETURN(out.weight_decay, h.Number("weight_decay"));
  OPTIMD_ASSIGN_OR_RETURN(out.adamw, h.Bool("adamw"));
  OPTIMD_ASSIGN_OR_RETURN(out.bias_correction, h.Bool("bias_correction"));
  OPTIMD_ASSIGN_OR_RETURN(out.maximize, h.Bool("maximize"));
  OPTIMD_ASSIGN_OR_RETURN(out.amsgrad, h.Bool("amsgrad"));
  // Files written before optimizers other than AdamW have none of these.
  if (jh->contains("optimizer")) {
    OPTIMD_ASSIGN_OR_RETURN(std::string name, h.String("optimizer"));
    auto kind = OptimizerFromName(name);
    if (!kind.ok()) return h.Bad("optimizer", "not a known optimizer");
    out.kind = *kind;
    OPTIMD_ASSIGN_OR_RETURN(out.momentum, h.Number("momentum"));
    OPTIMD_ASSIGN_OR_RETURN(out.dampening, h.Number("dampening"));
    OPTIMD_ASSIGN_OR_RETURN(out.nesterov, h.Bool("nesterov"));
  }
  absl::Status s = CheckHyperparameters(out, g.where());
  if (!s.ok()) return Malformed(path, std::string(s.message()));
  return out;
}

// Whether a header's layout is `l`. Files written before optimizers other
// than AdamW name neither the optimizer nor the slot count: such a layout
// is an AdamW one. Files written before the slot names name none.
bool LayoutMatches(const json& file, const Layout& l) {
  json mine = LayoutJson(l);
  if (file.is_object() && !file.contains("optimizer") &&
      l.optimizer == OptimizerKind::kAdamW) {
    mine.erase("optimizer");
    mine.erase("state_slots");
  }
  if (file.is_object() && !file.contains("slot_names")) {
    mine.erase("slot_names");
  }
  return file == mine;
}

// One tensor's metadata as a header gives it.
struct TensorHeader {
  std::string name;
  uint64_t numel = 0;
  bool frozen = false;
  const json* layout = nullptr;
};

// Version 1: {"name", "numel", "frozen", "keep_fp32", "layout"}.
absl::StatusOr<TensorHeader> ParseTensor(const json& j,
                                         const std::string& where,
                                         const std::string& path) {
  OPTIMD_ASSIGN_OR_RETURN(Fields f, Fields::Of(j, where, path));
  TensorHeader t;
  OPTIMD_ASSIGN_OR_RETURN(t.name, f.String("name"));
  OPTIMD_ASSIGN_OR_RETURN(t.numel, f.Uint("numel"));
  OPTIMD_ASSIGN_OR_RETURN(t.frozen, f.Bool("frozen"));
  OPTIMD_ASSIGN_OR_RETURN(t.layout, f.Get("layout"));
  return t;
}

// Version 2 (packed): [name, numel, layout index, flags(, shape)].
absl::StatusOr<TensorHeader> ParsePackedTensor(const json& j,
                                               const json& layouts,
                                               const std::string& where,
                                               const std::string& path) {
  if (!j.is_array() || (j.size() != 4 && j.size() != 5) || !j[0].is_string() ||
      !j[1].is_number_unsigned() || !j[2].is_number_unsigned() ||
      !j[3].is_number_unsigned() || j[2].get<uint64_t>() >= layouts.size() ||
      j[3].get<uint64_t>() > 3 ||
      (j.size() == 5 && !IsShapeOf(j[4], j[1].get<uint64_t>()))) {
    return Malformed(path, where + " is not [name, numel, layout index < " +
                               std::to_string(layouts.size()) +
                               ", flags(, shape holding numel)]");
  }
  TensorHeader t;
  t.name = j[0].get<std::string>();
  t.numel = j[1].get<uint64_t>();
  t.frozen = (j[3].get<uint64_t>() & 1) != 0;
  t.layout = &layouts[j[2].get<size_t>()];
  return t;
}

// Checks one group of the header against the registered group `g`.
// `layouts`: the packed format's layout table; null for version 1.
// `names`: the file's tensor names and the aliases of earlier groups.
absl::StatusOr<GroupHeader> ParseGroup(const json& jg, const Group& g,
                                       size_t index, const json* layouts,
                                       FileNames* names,
                                       const std::string& path) {
  OPTIMD_ASSIGN_OR_RETURN(Fields f,
                          Fields::Of(jg, absl::StrCat("group ", index), path));
  OPTIMD_ASSIGN_OR_RETURN(std::string id, f.String("id"));
  if (id != g.id) {
    return absl::FailedPreconditionError(
        absl::StrCat("group ", index, " is '", id.substr(0, kMaxNameBytes),
                     "' in ", path, " but '", g.id, "' in the session"));
  }
  GroupHeader out;
  OPTIMD_ASSIGN_OR_RETURN(out.step, f.Uint("step"));
  if (out.step > kMaxStepCounter) {
    return f.Bad(
        "step", absl::StrCat(out.step, ", past the largest ", kMaxStepCounter));
  }
  OPTIMD_ASSIGN_OR_RETURN(out.hyper, ParseHyper(f, path));
  OPTIMD_ASSIGN_OR_RETURN(const json* jt, f.Array("tensors"));
  if (jt->size() != g.tensors.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", g.id, "' has ", jt->size(), " tensors in ",
                     path, " but ", g.tensors.size(), " registered"));
  }
  OPTIMD_ASSIGN_OR_RETURN(out.missed,
                          ParseMissedSteps(jg, f, out.step, g.tensors.size()));
  for (size_t ti = 0; ti < g.tensors.size(); ++ti) {
    const TensorEntry& t = g.tensors[ti];
    const std::string where =
        absl::StrCat("tensor ", ti, " of group '", g.id, "'");
    OPTIMD_ASSIGN_OR_RETURN(
        TensorHeader th,
        layouts == nullptr
            ? ParseTensor((*jt)[ti], where, path)
            : ParsePackedTensor((*jt)[ti], *layouts, where, path));
    if (th.name != t.name || th.numel != t.numel || th.frozen != t.frozen ||
        !LayoutMatches(*th.layout, t.layout)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor '", t.name, "' (group '", g.id, "') does not match ", path,
          ": the file has '", th.name.substr(0, kMaxNameBytes), "' with ",
          th.numel, " elements, layout ", th.layout->dump(), "; registered: ",
          t.numel, " elements, layout ", LayoutJson(t.layout).dump()));
    }
  }
  OPTIMD_ASSIGN_OR_RETURN(out.aliases,
                          ParseAliases(jg, f, g.tensors.size(), names));
  OPTIMD_RETURN_IF_ERROR(CheckShards(jg, f, g.tensors.size()));
  return out;
}

// Checks the safetensors tensor of the run of pieces [first, end) (one
// key) and sets the pieces' offsets and the run's crc (on its last piece).
absl::Status ParseRun(const json& h, const json& crcs,
                      std::vector<Entry>& entries, size_t first, size_t end,
                      uint64_t data_bytes, const std::string& path) {
  const std::string& key = entries[first].key;
  uint64_t numel = 0, bytes = 0;
  for (size_t i = first; i < end; ++i) {
    numel += entries[i].numel;
    bytes += entries[i].bytes;
  }
  auto it = h.find(key);
  if (it == h.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " has no tensor '", key, "'"));
  }
  OPTIMD_ASSIGN_OR_RETURN(
      Fields f, Fields::Of(*it, absl::StrCat("tensor '", key, "'"), path));
  OPTIMD_ASSIGN_OR_RETURN(std::string dtype, f.String("dtype"));
  OPTIMD_ASSIGN_OR_RETURN(uint64_t shape_numel, f.ShapeNumel("shape"));
  OPTIMD_ASSIGN_OR_RETURN(std::vector<uint64_t> offsets,
                          f.Uints("data_offsets", 2));
  if (dtype != entries[first].dtype || shape_numel != numel ||
      offsets[1] < offsets[0] || offsets[1] - offsets[0] != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", key, "' in ", path, " is ", it->dump(), "; expected dtype ",
        entries[first].dtype, " shape [", numel, "] (", bytes, " bytes)"));
  }
  if (offsets[1] > data_bytes) {
    return absl::DataLossError(absl::StrCat(path, " is truncated: tensor '",
                                            key, "' ends at data byte ",
                                            offsets[1], " of ", data_bytes));
  }
  uint64_t offset = offsets[0];
  for (size_t i = first; i < end; ++i) {
    entries[i].offset = offset;
    entries[i].crc = 0;
    offset += entries[i].bytes;
  }
  auto c = crcs.find(key);
  if (c == crcs.end() || !c->is_string()) {
    return Malformed(path,
                     absl::StrCat("no crc32c string for tensor '", key, "'"));
  }
  auto crc = ParseCrcHex(c->get<std::string>());
  if (!crc.ok()) {
    return Malformed(path, absl::StrCat("the crc32c of tensor '", key, "' is ",
                                        crc.status().message()));
  }
  entries[end - 1].crc = *crc;
  return absl::OkStatus();
}

// Parses and checks a whole header against the registered groups, setting
// the entries' offsets and checksums. Changes no state.
absl::StatusOr<std::vector<GroupHeader>> ParseHeader(
    const std::string& header, const std::vector<Group*>& groups,
    std::vector<Entry>& entries, uint64_t data_bytes, const std::string& path) {
  OPTIMD_ASSIGN_OR_RETURN(json h, ParseJson(header, path, "the header"));
  auto not_ours = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not an optimd checkpoint (", why, ")"));
  };
  if (!h.is_object()) return not_ours("the header is not a JSON object");
  auto md = h.find("__metadata__");
  if (md == h.end() || !md->is_object()) return not_ours("no __metadata__");
  auto text = md->find("optimd");
  if (text == md->end() || !text->is_string()) {
    return not_ours("no __metadata__.optimd string");
  }
  const std::string& meta_text = text->get_ref<const std::string&>();
  OPTIMD_ASSIGN_OR_RETURN(json meta, ParseJson(meta_text, path, "metadata"));
  OPTIMD_ASSIGN_OR_RETURN(Fields m, Fields::Of(meta, "the metadata", path));
  OPTIMD_ASSIGN_OR_RETURN(uint64_t version, m.Uint("format_version"));
  if (version > kCheckpointFormatVersion || version == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, " has checkpoint format version ", version,
        "; this daemon reads versions 1 to ", kCheckpointFormatVersion,
        " (written by a newer optimd?)"));
  }
  // The version first: a newer format may checksum differently.
  if (auto mc = md->find("optimd_crc32c"); mc != md->end()) {
    auto want = mc->is_string() ? ParseCrcHex(mc->get<std::string>())
                                : absl::InvalidArgumentError("not a string");
    if (!want.ok() ||
        *want !=
            Crc32cExtend(0, reinterpret_cast<const uint8_t*>(meta_text.data()),
                         meta_text.size())) {
      return absl::DataLossError(
          absl::StrCat("the metadata of ", path,
                       " does not match its crc32c: the header is corrupt"));
    }
  }
  OPTIMD_ASSIGN_OR_RETURN(const json* jgroups, m.Array("groups"));
  if (jgroups->size() != groups.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " holds ", jgroups->size(), " groups; the session has ",
        groups.size(), " registered"));
  }
  const bool packed = version == 2;
  const json* layouts = nullptr;
  if (packed) {
    OPTIMD_ASSIGN_OR_RETURN(layouts, m.Array("layouts"));
  }
  std::vector<GroupHeader> out;
  FileNames names(groups);
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    OPTIMD_ASSIGN_OR_RETURN(
        GroupHeader g,
        ParseGroup((*jgroups)[gi], *groups[gi], gi, layouts, &names, path));
    out.push_back(std::move(g));
  }
  OPTIMD_ASSIGN_OR_RETURN(const json* crcs, m.Get("crc32c"));
  if (!crcs->is_object()) return m.Bad("crc32c", "not an object");
  Arrange(entries, packed);
  for (size_t first = 0; first < entries.size();) {
    size_t end = first + 1;
    while (!RunEnds(entries, end - 1)) ++end;
    OPTIMD_RETURN_IF_ERROR(
        ParseRun(h, *crcs, entries, first, end, data_bytes, path));
    first = end;
  }
  return out;
}

}  // namespace checkpoint_header
}  // namespace optimd
